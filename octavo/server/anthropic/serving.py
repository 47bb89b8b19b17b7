"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API, served by the
chat-completions pipeline (serving_chat.start_chat) so both APIs sample, call tools and count
tokens the same way.

A request becomes a ChatCompletionRequest: `system` a system message, `tool_use` blocks an
assistant's tool_calls, each `tool_result` a tool message, tool_choice any/tool/none the chat
layer's required/named/none. A final assistant message is a prefill the answer continues. The
answer's text, reasoning and tool calls become text, thinking and tool_use blocks; streams
become Anthropic's events (message_start, content_block_start/delta/stop, message_delta,
message_stop). message_start goes out at once with the prompt's token count.

These routes answer errors in Anthropic's shape, {"type": "error", "error": {type, message}}:
their route class re-renders what the handlers raise (OpenAIError) and body validation errors,
so the OpenAI endpoints' error handling stays as it is.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from pydantic import ValidationError

from octavo.server.anthropic.protocol import (
    AnthropicErrorResponse,
    ContentBlock,
    CountTokensRequest,
    CountTokensResponse,
    MediaBlockParam,
    MessageParam,
    MessageResponse,
    MessagesRequest,
    MessageUsage,
    StopReason,
    TextBlock,
    TextBlockParam,
    ThinkingBlock,
    ToolChoiceParam,
    ToolResultBlockParam,
    ToolUseBlock,
    ToolUseBlockParam,
)
from octavo.server.chat.serving import ChatRun, render_chat_prompt, start_chat
from octavo.server.context import ServerContext
from octavo.server.errors import OpenAIError, bad_request, validation_message
from octavo.server.protocol import ChatCompletionRequest, ChatCompletionResponse, DeltaMessage
from octavo.server.serving_common import (
    ENGINE_ERRORS,
    SSEResponse,
    client_closed,
    engine_error,
    sse,
)

# Anthropic's error types, by status
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               403: "permission_error", 404: "not_found_error", 413: "request_too_large",
               429: "rate_limit_error", 503: "overloaded_error", 529: "overloaded_error"}


def error_type(status: int) -> str:
    return ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")


def error_payload(status: int, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": error_type(status), "message": message}}


def anthropic_error(status: int, message: str) -> JSONResponse:
    return JSONResponse(error_payload(status, message), status_code=status)


class AnthropicRoute(APIRoute):
    """A route whose errors (raised OpenAIError, invalid bodies) come out in Anthropic's shape."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def anthropic_errors(request: Request) -> Response:
            try:
                return await handler(request)
            except OpenAIError as e:
                return anthropic_error(e.status, e.message)
            except RequestValidationError as e:
                return anthropic_error(400, validation_message(e)[0])

        return anthropic_errors


def messages_router(ctx: ServerContext) -> APIRouter:
    """The two routes, for app.include_router."""
    router = APIRouter(route_class=AnthropicRoute)
    errors: dict[int | str, dict[str, Any]] = {
        404: {"model": AnthropicErrorResponse, "description": "the model is not served here"},
    }

    @router.post("/v1/messages", response_class=Response, responses={
        200: {"model": MessageResponse, "description": "the message, or with `stream: true` "
              "Server-Sent Events: message_start, content blocks, message_delta, message_stop",
              "content": {"text/event-stream": {"schema": SSE_EVENT}}},
        **errors,
        500: {"model": AnthropicErrorResponse, "description": "the model step failed"},
    })
    async def messages(body: MessagesRequest, raw: Request) -> Response:
        return await create_message(ctx, body, raw)

    @router.post("/v1/messages/count_tokens", responses=errors)
    async def messages_count_tokens(body: CountTokensRequest) -> CountTokensResponse:
        return await count_tokens(ctx, body)

    return router


SSE_EVENT = {"type": "object", "required": ["event", "data"],
             "properties": {"event": {"type": "string"}, "data": {"type": "string"}}}


# ---- endpoints ------------------------------------------------------------------------------
async def create_message(ctx: ServerContext, body: MessagesRequest, raw: Request) -> Response:
    ctx.check_model(body.model)  # before the translation's 400s, as count_tokens does
    run = await start_chat(ctx, to_chat_request(body))
    if body.stream:
        return SSEResponse(message_events(run, body.model), on_close=run.cancel)
    response = await run.response(raw)
    if response is None:
        return client_closed()
    return JSONResponse(to_message(response, body.model).model_dump())


async def count_tokens(ctx: ServerContext, body: CountTokensRequest) -> CountTokensResponse:
    """The prompt's length as /v1/messages renders it (start_chat's steps up to the template)."""
    ctx.check_model(body.model)
    ids, _ = await render_chat_prompt(ctx, to_chat_request(body))
    return CountTokensResponse(input_tokens=len(ids))


# ---- request -> chat completion -------------------------------------------------------------
def to_chat_request(body: CountTokensRequest) -> ChatCompletionRequest:
    if all(m.role == "system" for m in body.messages):
        raise bad_request("messages: at least one user or assistant message is needed (system "
                          "messages join the system prompt)", "messages")
    messages = chat_messages(body)
    last = messages[-1]
    fields: dict[str, Any] = {
        "model": body.model,
        "messages": messages,
        # an assistant turn with text at the end is a prefill: the answer continues it
        "continue_final_message": (last["role"] == "assistant" and bool(last["content"])
                                   and not last.get("tool_calls")),
    }
    if body.tools:
        fields["tools"] = [{"type": "function", "function": {
            "name": t.name, "description": t.description, "parameters": t.input_schema}}
            for t in body.tools]
    if body.tool_choice is not None:
        fields["tool_choice"], parallel = chat_tool_choice(body.tool_choice)
        fields["parallel_tool_calls"] = parallel
    if isinstance(body, MessagesRequest):
        fields.update(max_tokens=body.max_tokens, temperature=body.temperature,
                      top_p=body.top_p, top_k=body.top_k, stop=body.stop_sequences or None,
                      stream=body.stream)
        if body.thinking is not None and body.thinking.type == "enabled":
            fields["thinking_token_budget"] = body.thinking.budget_tokens
        if body.stream:
            fields["stream_options"] = {"include_usage": True}
    try:
        return ChatCompletionRequest.model_validate(
            {k: v for k, v in fields.items() if v is not None})
    except ValidationError as e:  # what the chat layer refuses beyond the Anthropic models
        err = e.errors()[0]
        raise bad_request(f"{'.'.join(map(str, err['loc']))}: {err['msg']}") from None


def chat_tool_choice(choice: ToolChoiceParam) -> tuple[Any, bool]:
    """Anthropic's tool_choice -> chat's tool_choice and parallel_tool_calls."""
    parallel = not getattr(choice, "disable_parallel_tool_use", False)
    if choice.type == "tool":
        return {"type": "function", "function": {"name": choice.name}}, parallel
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type], parallel


def chat_messages(body: CountTokensRequest) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    system = _system_parts(body)
    if system:
        out.append({"role": "system", "content": system})
    calls: set[str] = set()
    for i, m in enumerate(body.messages):
        if m.role == "system":
            continue
        out += (_assistant_message(i, m, calls) if m.role == "assistant"
                else _user_messages(i, m, calls))
    return out


def _system_parts(body: CountTokensRequest) -> str | list[dict[str, str]] | None:
    """`system`, then the text of every system message inside `messages` as paragraphs of
    it, in order: one system prompt (chat templates take a single system message, first)."""
    hoisted: list[str] = []
    for i, m in enumerate(body.messages):
        if m.role != "system":
            continue
        blocks = [TextBlockParam(type="text", text=m.content)] if isinstance(m.content, str) \
            else m.content
        for j, block in enumerate(blocks):
            if not isinstance(block, TextBlockParam):
                param = f"messages.{i}.content.{j}"
                raise bad_request(f"{param}: a system message holds text blocks only, not "
                                  f"{block.type}", param)
        hoisted.append("".join(b.text for b in blocks if isinstance(b, TextBlockParam)))
    system = _text_parts(body.system) if body.system else None
    if not hoisted:
        return system
    first = [] if system is None else [system if isinstance(system, str)
                                       else "".join(p["text"] for p in system)]
    return "\n\n".join(first + hoisted)


def _text_parts(content: str | list[TextBlockParam]) -> str | list[dict[str, str]]:
    if isinstance(content, str):
        return content
    return [{"type": "text", "text": b.text} for b in content]


def _unsupported(block: MediaBlockParam, param: str) -> OpenAIError:
    return bad_request(f"{param}: {block.type} content is not supported", param)


def _assistant_message(i: int, m: MessageParam, calls: set[str]) -> list[dict[str, Any]]:
    if isinstance(m.content, str):
        return [{"role": "assistant", "content": m.content}]
    texts: list[dict[str, str]] = []
    tool_calls = []
    for j, block in enumerate(m.content):
        param = f"messages.{i}.content.{j}"
        if isinstance(block, TextBlockParam):
            texts.append({"type": "text", "text": block.text})
        elif isinstance(block, ToolUseBlockParam):
            calls.add(block.id)
            tool_calls.append({"id": block.id, "type": "function", "function": {
                "name": block.name, "arguments": json.dumps(block.input, ensure_ascii=False)}})
        elif isinstance(block, MediaBlockParam):
            raise _unsupported(block, param)
        elif isinstance(block, ToolResultBlockParam):
            raise bad_request(f"{param}: tool_result blocks belong in user messages", param)
        # thinking blocks of earlier turns are left out, as chat templates drop reasoning
    message: dict[str, Any] = {"role": "assistant", "content": texts or None}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return [message]


def _user_messages(i: int, m: MessageParam, calls: set[str]) -> list[dict[str, Any]]:
    """One tool message per tool_result; the text between them, in order, as user messages."""
    if isinstance(m.content, str):
        return [{"role": "user", "content": m.content}]
    out: list[dict[str, Any]] = []
    texts: list[dict[str, str]] = []
    for j, block in enumerate(m.content):
        param = f"messages.{i}.content.{j}"
        if isinstance(block, TextBlockParam):
            texts.append({"type": "text", "text": block.text})
        elif isinstance(block, ToolResultBlockParam):
            if block.tool_use_id not in calls:
                raise bad_request(f"{param}.tool_use_id: a tool_result must answer a tool_use "
                                  f"block of an earlier assistant message; none has id "
                                  f"{block.tool_use_id!r}", f"{param}.tool_use_id")
            if texts:
                out.append({"role": "user", "content": texts})
                texts = []
            out.append({"role": "tool", "tool_call_id": block.tool_use_id,
                        "content": _tool_result_text(block, param)})
        elif isinstance(block, MediaBlockParam):
            raise _unsupported(block, param)
        elif isinstance(block, ToolUseBlockParam):
            raise bad_request(f"{param}: tool_use blocks belong in assistant messages", param)
    if texts or not out:
        out.append({"role": "user", "content": texts})
    return out


def _tool_result_text(block: ToolResultBlockParam, param: str) -> str:
    if block.content is None or isinstance(block.content, str):
        text = block.content or ""
    else:
        parts = []
        for k, part in enumerate(block.content):
            if isinstance(part, MediaBlockParam):
                raise _unsupported(part, f"{param}.content.{k}")
            parts.append(part.text)
        text = "".join(parts)
    return f"Error: {text}" if block.is_error else text


# ---- chat completion -> message -------------------------------------------------------------
def message_id(chat_id: str) -> str:
    return f"msg_{chat_id.removeprefix('chatcmpl-')}"


def tool_use_id(call_id: str) -> str:
    return f"toolu_{call_id.removeprefix('call_')}"


def stop_reason(finish_reason: str | None, matched: int | str | None, called: bool
                ) -> tuple[StopReason, str | None]:
    """Anthropic's stop_reason and stop_sequence; chat's stop_reason is the matched stop
    string (or a stop token id) when a stop ended the output."""
    if finish_reason == "length":
        return "max_tokens", None
    if called or finish_reason == "tool_calls":
        return "tool_use", None
    if isinstance(matched, str):
        return "stop_sequence", matched
    return "end_turn", None


def _tool_input(arguments: str) -> dict[str, Any]:
    value = json.loads(arguments)  # the tool parsers and the grammar give JSON objects
    return value if isinstance(value, dict) else {}


def to_message(response: ChatCompletionResponse, model: str) -> MessageResponse:
    choice = response.choices[0]
    m = choice.message
    content: list[ContentBlock] = []
    if m.reasoning_content:
        content.append(ThinkingBlock(thinking=m.reasoning_content))
    if m.content:
        content.append(TextBlock(text=m.content))
    content += [ToolUseBlock(id=tool_use_id(c.id), name=c.function.name,
                             input=_tool_input(c.function.arguments)) for c in m.tool_calls]
    reason, sequence = stop_reason(choice.finish_reason, choice.stop_reason, bool(m.tool_calls))
    return MessageResponse(
        id=message_id(response.id), model=model, content=content or [TextBlock(text="")],
        stop_reason=reason, stop_sequence=sequence,
        usage=MessageUsage(input_tokens=response.usage.prompt_tokens,
                           output_tokens=response.usage.completion_tokens),
    )


# ---- stream ---------------------------------------------------------------------------------
def event(name: str, payload: dict[str, Any]) -> str:
    return f"event: {name}\n" + sse(json.dumps({"type": name, **payload}, ensure_ascii=False))


class BlockEvents:
    """Chat deltas -> content block events: one block open at a time, a new one whenever the
    kind of delta changes or a new tool call starts."""

    def __init__(self) -> None:
        self.index = -1
        self.open: str | None = None  # "text", "thinking" or "tool_use"
        self.called = False

    def _start(self, block: dict[str, Any]) -> list[str]:
        out = self._stop()
        self.index += 1
        self.open = block["type"]
        return [*out, event("content_block_start", {"index": self.index,
                                                    "content_block": block})]

    def _stop(self) -> list[str]:
        if self.open is None:
            return []
        self.open = None
        return [event("content_block_stop", {"index": self.index})]

    def _delta(self, delta: dict[str, Any]) -> str:
        return event("content_block_delta", {"index": self.index, "delta": delta})

    def feed(self, d: DeltaMessage) -> list[str]:
        out: list[str] = []
        if d.reasoning_content:
            if self.open != "thinking":
                out += self._start({"type": "thinking", "thinking": "", "signature": ""})
            out.append(self._delta({"type": "thinking_delta", "thinking": d.reasoning_content}))
        if d.content:
            if self.open != "text":
                out += self._start({"type": "text", "text": ""})
            out.append(self._delta({"type": "text_delta", "text": d.content}))
        for call in d.tool_calls or []:
            args = call.function.arguments if call.function else None
            if call.id is not None:
                self.called = True
                name = call.function.name if call.function else None
                out += self._start({"type": "tool_use", "id": tool_use_id(call.id),
                                    "name": name or "", "input": {}})
            if args and self.open == "tool_use":
                out.append(self._delta({"type": "input_json_delta", "partial_json": args}))
        return out

    def close(self) -> list[str]:
        """Stop the open block; an answer with no block at all gets one empty text block."""
        if self.index < 0:
            return [*self._start({"type": "text", "text": ""}), *self._stop()]
        return self._stop()


async def message_events(run: ChatRun, model: str) -> AsyncIterator[str]:
    blocks = BlockEvents()
    finish: str | None = None
    matched: int | str | None = None
    output_tokens = 0
    input_tokens = run.num_prompt_tokens
    try:
        yield event("message_start", {"message": {
            "id": message_id(run.id), "type": "message", "role": "assistant", "model": model,
            "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": input_tokens, "output_tokens": 0}}})
        async for chunk in run.chunks():
            out = []
            for choice in chunk.choices:
                out += blocks.feed(choice.delta)
                if choice.finish_reason is not None:
                    finish, matched = choice.finish_reason, choice.stop_reason
            if chunk.usage is not None:
                output_tokens = chunk.usage.completion_tokens
            if out:
                yield "".join(out)
        reason, sequence = stop_reason(finish, matched, blocks.called)
        yield "".join([
            *blocks.close(),
            event("message_delta", {
                "delta": {"stop_reason": reason, "stop_sequence": sequence},
                "usage": {"input_tokens": input_tokens, "output_tokens": output_tokens}}),
            event("message_stop", {}),
        ])
    except ENGINE_ERRORS as e:
        yield event("error", {"error": error_payload(engine_error(e).status, str(e))["error"]})
    finally:
        run.cancel()
