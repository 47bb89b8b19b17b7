"""POST /v1/chat/completions: messages -> the model's chat template -> one engine request.

Streaming follows OpenAI: a first chunk per choice carries only the role, then deltas of
content, reasoning_content and tool_calls, then a chunk with the finish reason, then (if
asked) a usage chunk with no choices. `max_tokens` defaults to what fits in max_model_len, as
in vLLM.

`start_chat` checks a request and starts it; the ChatRun it returns gives the whole response
or the stream's chunks. /v1/responses and /v1/messages run through it too and translate its
chunks into their own events.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from octavo.engine.async_engine import RequestStream
from octavo.outputs import CompletionOutput, RequestOutput
from octavo.server.chat.output import ChoiceStream, final_message
from octavo.server.chat.reasoning import ReasoningParser, get_reasoning_parser
from octavo.server.chat.structured import structured_outputs_of
from octavo.server.chat.tools import (
    ToolPlan,
    check_tool_messages,
    plan_tools,
    template_messages,
    template_renders_tools,
    with_tool_prompt,
)
from octavo.server.context import ServerContext
from octavo.server.errors import bad_request
from octavo.server.logprobs import chat_logprobs
from octavo.server.protocol import (
    ChatChoice,
    ChatChoiceLogprobs,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    ChatStreamChoice,
    DeltaMessage,
    UsageInfo,
)
from octavo.server.serving_common import (
    ENGINE_ERRORS,
    SSE_DONE,
    SSEResponse,
    StreamUsage,
    cancel_all,
    check_context_length,
    check_max_tokens,
    client_closed,
    collect,
    engine_error,
    merge,
    sse,
    sse_error,
    start_requests,
    to_sampling_params,
    usage,
)


def messages_to_dicts(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Plain dicts for the template; text content parts are joined (no images here)."""
    if not messages:
        raise bad_request("messages must not be empty", "messages")
    result = []
    for m in messages:
        d = m.model_dump(exclude_none=True)
        if isinstance(m.content, list):
            d["content"] = "".join(part.text for part in m.content)
        elif m.content is None:
            d["content"] = ""
        result.append(d)
    return result


async def create_chat_completion(
    ctx: ServerContext, body: ChatCompletionRequest, raw: Request
) -> Response:
    run = await start_chat(ctx, body)
    if body.stream:
        return SSEResponse(run.sse(), on_close=run.cancel)
    response = await run.response(raw)
    if response is None:
        return client_closed()
    return JSONResponse(response.model_dump())


async def start_chat(ctx: ServerContext, body: ChatCompletionRequest) -> ChatRun:
    """Check a chat request, render its prompt and start it in the engine (OpenAIError for
    what is wrong with it)."""
    ctx.check_model(body.model)
    ctx.check_capacity()
    top_k = None
    if body.logprobs:
        top_k = body.top_logprobs or 0
    elif body.top_logprobs:
        raise bad_request("top_logprobs needs logprobs=true", "top_logprobs")
    check_max_tokens(ctx, max_tokens=body.max_tokens,
                     max_completion_tokens=body.max_completion_tokens)
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else (
        body.max_tokens)
    ids, tools = await render_chat_prompt(ctx, body)
    constraint, constraint_param = structured_outputs_of(body, body.response_format)
    if tools.constraint is not None:
        if constraint is not None:
            raise bad_request(f"tool_choice {tools.mode!r} constrains the output itself; it "
                              "cannot be combined with response_format or structured_outputs",
                              "tool_choice")
        constraint, constraint_param = tools.constraint, "tools"
    check_context_length(ctx, len(ids), max_tokens, "messages")
    params = to_sampling_params(ctx, body, max_tokens=max_tokens, logprobs=top_k,
                                structured_outputs=constraint)
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    streams = await start_requests(ctx, request_id, [{"prompt_token_ids": ids,
                                                      "cache_salt": body.cache_salt}],
                                   params, body.priority, constraint_param or "messages")
    reasoning = (get_reasoning_parser(ctx.config.reasoning_parser)
                 if ctx.config.reasoning_parser else None)
    run = ChatRun(ctx, body, request_id, streams, top_k, tools, reasoning)
    run.num_prompt_tokens = len(ids)
    return run


async def render_chat_prompt(ctx: ServerContext, body: ChatCompletionRequest
                             ) -> tuple[list[int], ToolPlan]:
    """The prompt's token ids (messages and tools through the chat template) and the tool
    plan; /v1/messages/count_tokens counts the same ids."""
    check_tool_messages(body.messages)
    tools = plan_tools(body, auto_enabled=ctx.config.enable_auto_tool_choice,
                       parser_name=ctx.config.tool_call_parser)
    messages = template_messages(messages_to_dicts(body.messages))
    template_tools = None
    if tools.tools:
        if template_renders_tools(ctx.chat_template):
            template_tools = tools.tools
        else:
            messages = with_tool_prompt(messages, tools)
    ids = await ctx.apply_chat_template(messages, body.add_generation_prompt,
                                        body.continue_final_message, tools=template_tools,
                                        template_kwargs=body.chat_template_kwargs)
    return ids, tools


class ChatRun:
    """A started chat request: its whole response, or its stream of chunks."""

    def __init__(self, ctx: ServerContext, body: ChatCompletionRequest, request_id: str,
                 streams: list[RequestStream], top_k: int | None, tools: ToolPlan,
                 reasoning: ReasoningParser | None) -> None:
        self.ctx = ctx
        self.body = body
        self.id = request_id
        self.streams = streams
        self.top_k = top_k
        self.tools = tools
        self.reasoning = reasoning
        self.created = int(time.time())
        self.usage: UsageInfo | None = None  # the tokens so far, once the engine sent some
        self.num_prompt_tokens = 0

    def cancel(self) -> None:
        cancel_all(self.streams)

    def _logprobs(self, token_ids: list[int], positions: list | None
                  ) -> ChatChoiceLogprobs | None:
        if self.top_k is None:
            return None
        return chat_logprobs(self.ctx, token_ids, positions or [], self.top_k)

    def _finish_reason(self, o: CompletionOutput, called: bool) -> str | None:
        if o.finish_reason == "stop" and called and self.tools.mode != "named":
            return "tool_calls"
        return o.finish_reason

    # ---- whole response ---------------------------------------------------------------------
    async def response(self, raw: Request) -> ChatCompletionResponse | None:
        """The response once every choice finished; None when the client left first."""
        try:
            finals = await collect(raw, self.streams)
        except ENGINE_ERRORS as e:
            raise engine_error(e) from e
        if finals is None:
            return None
        return self.to_response(finals[0])

    def to_response(self, out: RequestOutput) -> ChatCompletionResponse:
        choices = []
        for o in sorted(out.outputs, key=lambda o: o.index):
            message, called = final_message(o.text, self.tools, self.reasoning)
            choices.append(ChatChoice(
                index=o.index, message=message,
                logprobs=self._logprobs(o.token_ids, o.logprobs),
                finish_reason=self._finish_reason(o, called), stop_reason=o.stop_reason,
            ))
        self.usage = usage([out])
        return ChatCompletionResponse(id=self.id, created=self.created,
                                      model=self.ctx.model_name, choices=choices,
                                      usage=self.usage)

    # ---- stream -----------------------------------------------------------------------------
    def _chunk(self, choices: list[ChatStreamChoice],
               usage_info: UsageInfo | None = None) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.id, created=self.created, model=self.ctx.model_name,
                                   choices=choices, usage=usage_info)

    async def chunks(self) -> AsyncIterator[ChatCompletionChunk]:
        """The stream's chunks; raises RequestAbortedError / EngineStepError if the engine
        fails the request. The caller cancels the run when it stops reading. The engine sends
        DELTA outputs: each carries only what its step added."""
        opts = self.body.stream_options
        include_usage = bool(opts and opts.include_usage)
        continuous = bool(opts and opts.continuous_usage_stats)
        n = self.body.n
        done = [False] * n
        counts = StreamUsage()
        parsers = [ChoiceStream(self.tools, self.reasoning) for _ in range(n)]
        for i in range(n):
            yield self._chunk([ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant",
                                                                            content=""))])
        async for _, out in merge(self.streams):
            counts.add(0, out)
            self.usage = counts.usage()
            for o in out.outputs:
                i = o.index
                if done[i]:
                    continue
                if not (o.text or o.finish_reason or (self.top_k is not None and o.token_ids)):
                    continue
                lp = self._logprobs(o.token_ids, o.logprobs)
                done[i] = o.finish_reason is not None
                delta = parsers[i].feed(o.text) if o.text else None
                if done[i]:
                    delta = _merge_deltas(delta, parsers[i].finish())
                if delta is None and lp is None and not done[i]:
                    continue
                choice = ChatStreamChoice(
                    index=i, delta=delta or DeltaMessage(), logprobs=lp,
                    finish_reason=(self._finish_reason(o, parsers[i].called) if done[i]
                                   else None),
                    stop_reason=o.stop_reason,
                )
                yield self._chunk([choice], self.usage if continuous else None)
        if include_usage and self.usage is not None:
            yield self._chunk([], self.usage)

    async def sse(self) -> AsyncIterator[str]:
        try:
            async for chunk in self.chunks():
                yield sse(chunk.model_dump_json())
        except ENGINE_ERRORS as e:
            yield sse_error(e)
        finally:
            self.cancel()
        yield SSE_DONE


def _merge_deltas(a: DeltaMessage | None, b: DeltaMessage | None) -> DeltaMessage | None:
    if a is None or b is None:
        return a or b
    return DeltaMessage(
        content=((a.content or "") + (b.content or "")) or None,
        reasoning_content=((a.reasoning_content or "") + (b.reasoning_content or "")) or None,
        tool_calls=((a.tool_calls or []) + (b.tool_calls or [])) or None,
    )
