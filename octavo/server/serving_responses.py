"""POST /v1/responses (OpenAI's Responses API), GET and DELETE /v1/responses/{id}, served
through the chat-completions pipeline.

A request becomes a ChatCompletionRequest (instructions -> a first system message; the stored
conversation of `previous_response_id`, then the input items -> messages; function tools,
tool_choice and `text.format` -> chat's tools, tool_choice and response_format), so every check
and every constraint of chat applies unchanged; the chat response, or its chunks, become the
response object, or its events (ResponseEvents). A stored response keeps the chat messages
that produced it plus its output (response_store.py), which is what `previous_response_id`
continues.
"""

from __future__ import annotations

import copy
import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from octavo.server.context import ServerContext
from octavo.server.errors import OpenAIError, bad_request
from octavo.server.protocol import (
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatResponseMessage,
    ErrorResponse,
    UsageInfo,
)
from octavo.server.protocol_responses import (
    DeletedResponse,
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionToolChoice,
    MessageItem,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
    TextPart,
)
from octavo.server.response_store import StoredResponse, store_of
from octavo.server.serving_chat import ChatRun, start_chat
from octavo.server.serving_common import ENGINE_ERRORS, SSEResponse, client_closed, sse

# chat's parameter names -> the Responses API's, in the errors of the chat layer
_PARAMS = {"messages": "input", "max_tokens": "max_output_tokens",
           "max_completion_tokens": "max_output_tokens", "response_format": "text.format"}


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


# ---- endpoints ------------------------------------------------------------------------------
def responses_router(ctx: ServerContext) -> APIRouter:
    """The three routes, for app.include_router."""
    router = APIRouter()

    @router.post("/v1/responses", response_class=Response, responses=CREATE_RESPONSES)
    async def responses_create(body: ResponsesRequest, raw: Request) -> Response:
        return await create_response(ctx, body, raw)

    @router.get("/v1/responses/{response_id}", response_class=Response,
                responses=RETRIEVE_RESPONSES)
    async def responses_retrieve(response_id: str) -> Response:
        return await retrieve_response(ctx, response_id)

    @router.delete("/v1/responses/{response_id}", response_class=Response,
                   responses=DELETE_RESPONSES)
    async def responses_delete(response_id: str) -> Response:
        return await delete_response(ctx, response_id)

    # Starlette's 405 names the methods of the first route of a path only: this one names both
    @router.api_route("/v1/responses/{response_id}", include_in_schema=False,
                      methods=["POST", "PUT", "PATCH", "OPTIONS", "HEAD"])
    async def responses_other_methods(response_id: str) -> Response:
        raise StarletteHTTPException(405, headers={"Allow": "GET, DELETE"})

    return router


async def create_response(ctx: ServerContext, body: ResponsesRequest, raw: Request) -> Response:
    """The response object, or its event stream; stored unless store=false."""
    if body.background:
        raise bad_request("background responses are not supported", "background")
    previous = None
    if body.previous_response_id is not None:
        previous = store_of(ctx).get(body.previous_response_id)
        if previous is None:
            raise OpenAIError(404, f"Previous response with id '{body.previous_response_id}' "
                              "not found.", "previous_response_id")
    conversation = conversation_messages(body, previous.messages if previous else [])
    chat = to_chat_request(body, conversation)
    try:
        run = await start_chat(ctx, chat)
    except OpenAIError as e:
        raise _renamed(e, body) from None
    response_id = _new_id("resp")
    events = ResponseEvents(skeleton(body, response_id, ctx.model_name))
    if body.stream:
        return SSEResponse(_stream(ctx, body, run, events, conversation), on_close=run.cancel)
    result = await run.response(raw)
    if result is None:
        return client_closed()
    choice = result.choices[0]
    response = events.whole(choice.message, choice.finish_reason, result.usage)
    if body.store:
        _keep(ctx, response, conversation, choice.message)
    return JSONResponse(response)


async def retrieve_response(ctx: ServerContext, response_id: str) -> JSONResponse:
    """A stored response as it was sent; 404 once deleted or evicted."""
    entry = store_of(ctx).get(response_id)
    if entry is None:
        raise _not_found(response_id)
    return JSONResponse(entry.response)


async def delete_response(ctx: ServerContext, response_id: str) -> JSONResponse:
    if not store_of(ctx).delete(response_id):
        raise _not_found(response_id)
    return JSONResponse(DeletedResponse(id=response_id).model_dump())


def _not_found(response_id: str) -> OpenAIError:
    return OpenAIError(404, f"Response with id '{response_id}' not found.", "response_id")


def _renamed(e: OpenAIError, body: ResponsesRequest) -> OpenAIError:
    """A chat-layer error, with the parameter named as this API names it."""
    if e.param:
        head = e.param.split(".", 1)[0]
        if head in _PARAMS:
            e.param = _PARAMS[head]
    if body.truncation == "auto" and "max_model_len" in e.message:
        e.message += ("; truncation 'auto' cannot help: octavo does not drop input items, "
                      "shorten the input instead")
    return e


def _keep(ctx: ServerContext, response: dict[str, Any], conversation: list[dict[str, Any]],
          message: ChatResponseMessage) -> None:
    store_of(ctx).put(response["id"], StoredResponse(
        response=response, messages=[*conversation, assistant_message(message)]))


# ---- request -> chat ------------------------------------------------------------------------
def conversation_messages(body: ResponsesRequest,
                          previous: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The chat messages of the conversation: the previous response's, then the input items'
    (instructions are not part of it: they are never carried over)."""
    if body.input is None and not previous:
        raise bad_request("input is required (or previous_response_id)", "input")
    if isinstance(body.input, str):
        items: list[Any] = [MessageItem(role="user", content=body.input)]
    else:
        items = list(body.input or [])
    messages = [dict(m) for m in previous]
    calls = {c["id"] for m in messages for c in m.get("tool_calls") or []}
    for i, item in enumerate(items):
        if isinstance(item, MessageItem):
            messages.append({"role": item.role, "content": _text(item.content)})
        elif isinstance(item, FunctionCallItem):
            _check_arguments(item.arguments, i)
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last["tool_calls"] = [*(last.get("tool_calls") or []), call]  # parallel calls
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            calls.add(item.call_id)
        elif isinstance(item, FunctionCallOutputItem):
            if item.call_id not in calls:
                raise bad_request(f"input item {i}: no earlier function_call has call_id "
                                  f"{item.call_id!r}; a function_call_output answers one",
                                  f"input.{i}.call_id")
            messages.append({"role": "tool", "tool_call_id": item.call_id,
                             "content": _text(item.output)})
        # reasoning items do not reach the model
    if not messages:
        raise bad_request("input has no message", "input")
    return messages


def _text(content: str | list[TextPart]) -> str:
    return content if isinstance(content, str) else "".join(p.text for p in content)


def _check_arguments(arguments: str, i: int) -> None:
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError as e:
        raise bad_request(f"input item {i}: arguments are not valid JSON: {e}",
                          f"input.{i}.arguments") from None
    if not isinstance(value, dict):
        raise bad_request(f"input item {i}: arguments must be a JSON object",
                          f"input.{i}.arguments")


def to_chat_request(body: ResponsesRequest,
                    conversation: list[dict[str, Any]]) -> ChatCompletionRequest:
    """The chat request this response runs as (validated as chat validates its own)."""
    messages = ([{"role": "system", "content": body.instructions}] if body.instructions
                else []) + conversation
    chat: dict[str, Any] = {
        "model": body.model, "messages": messages, "stream": body.stream,
        "max_tokens": body.max_output_tokens, "temperature": body.temperature,
        "top_p": body.top_p, "user": body.user, "parallel_tool_calls": body.parallel_tool_calls,
    }
    if body.stream:
        chat["stream_options"] = {"include_usage": True}
    if body.tools:
        chat["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"},
                                                                       exclude_none=True)}
                         for t in body.tools]
    if isinstance(body.tool_choice, FunctionToolChoice):
        chat["tool_choice"] = {"type": "function", "function": {"name": body.tool_choice.name}}
    elif body.tool_choice is not None:
        chat["tool_choice"] = body.tool_choice
    fmt = body.text.format if body.text else None
    if fmt is not None and fmt.type == "json_object":
        chat["response_format"] = {"type": "json_object"}
    elif fmt is not None and fmt.type == "json_schema":
        spec = {"name": fmt.name or "response", "schema": fmt.json_schema,
                "description": fmt.description, "strict": fmt.strict}
        chat["response_format"] = {"type": "json_schema",
                                   "json_schema": {k: v for k, v in spec.items()
                                                   if v is not None}}
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in chat.items()
                                                     if v is not None})
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(x) for x in err.get("loc", ()))
        raise bad_request(f"{loc}: {err.get('msg')}", _PARAMS.get(loc.split(".")[0], loc)
                          or None) from None


def assistant_message(message: ChatResponseMessage) -> dict[str, Any]:
    """The output as the chat message a later turn sends back (reasoning left out)."""
    out: dict[str, Any] = {"role": "assistant", "content": message.content}
    if message.tool_calls:
        out["tool_calls"] = [c.model_dump() for c in message.tool_calls]
    return out


def skeleton(body: ResponsesRequest, response_id: str, model: str) -> dict[str, Any]:
    """The response object's fields that echo the request (status in_progress, no output)."""
    fmt = body.text.format if body.text and body.text.format else None
    text = {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt
            else {"type": "text"}}
    if body.text and body.text.verbosity:
        text["verbosity"] = body.text.verbosity
    return ResponseObject(
        id=response_id, status="in_progress", model=model, instructions=body.instructions,
        tools=body.tools or [], tool_choice=body.tool_choice or "auto",
        parallel_tool_calls=body.parallel_tool_calls is not False,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        max_output_tokens=body.max_output_tokens,
        previous_response_id=body.previous_response_id, store=body.store, text=text,
        metadata=body.metadata or {}, user=body.user, reasoning=body.reasoning,
        truncation=body.truncation or "disabled",
    ).model_dump(mode="json", by_alias=True)


def _usage(u: UsageInfo | None) -> dict[str, Any] | None:
    if u is None:
        return None
    return ResponseUsage(input_tokens=u.prompt_tokens, output_tokens=u.completion_tokens,
                         total_tokens=u.total_tokens).model_dump()


# ---- chat -> response, and events -----------------------------------------------------------
class ResponseEvents:
    """The output items of one response, and the events that build them from chat chunks.

    One item is open at a time (reasoning, a message, or a function call); an item of another
    kind closes it, as OpenAI streams them. `whole` builds the same items from a whole chat
    message.
    """

    def __init__(self, response: dict[str, Any]) -> None:
        self.response = response
        self.seq = 0
        self.items: list[dict[str, Any]] = []
        self.open: int | None = None  # output index of the open item
        self.calls: dict[int, int] = {}  # chat tool-call index -> output index
        self.finish_reason: str | None = None
        self.usage: UsageInfo | None = None

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return event

    def _snapshot(self, status: str) -> dict[str, Any]:
        return {**self.response, "status": status, "output": copy.deepcopy(self.items),
                "usage": _usage(self.usage)}

    # -- items --
    def _add(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        events = self._close()
        self.items.append(item)
        self.open = len(self.items) - 1
        added = {**item, "content": []} if "content" in item else dict(item)
        if item["type"] == "function_call":
            added["arguments"] = ""
        events.append(self._event("response.output_item.added", output_index=self.open,
                                  item=added))
        if item["type"] in ("message", "reasoning"):
            part = item["content"][0]
            events.append(self._event("response.content_part.added", item_id=item["id"],
                                      output_index=self.open, content_index=0,
                                      part={**part, "text": ""}))
        return events

    def _close(self, status: str = "completed") -> list[dict[str, Any]]:
        if self.open is None:
            return []
        index, self.open = self.open, None
        item = self.items[index]
        item["status"] = status
        ids = {"item_id": item["id"], "output_index": index}
        if item["type"] == "function_call":
            return [self._event("response.function_call_arguments.done", **ids,
                                name=item["name"], arguments=item["arguments"]),
                    self._event("response.output_item.done", output_index=index, item=item)]
        part = item["content"][0]
        done = ("response.output_text.done" if item["type"] == "message"
                else "response.reasoning_text.done")
        extra = {"logprobs": []} if item["type"] == "message" else {}
        return [self._event(done, **ids, content_index=0, text=part["text"], **extra),
                self._event("response.content_part.done", **ids, content_index=0, part=part),
                self._event("response.output_item.done", output_index=index, item=item)]

    def _text(self, kind: str, delta: str) -> list[dict[str, Any]]:
        events = []
        current = self.items[self.open] if self.open is not None else None
        if current is None or current["type"] != kind:
            events += self._add(_message("") if kind == "message" else _reasoning(""))
        assert self.open is not None
        item = self.items[self.open]
        item["content"][0]["text"] += delta
        ids = {"item_id": item["id"], "output_index": self.open, "content_index": 0}
        if kind == "message":
            events.append(self._event("response.output_text.delta", **ids, delta=delta,
                                      logprobs=[]))
        else:
            events.append(self._event("response.reasoning_text.delta", **ids, delta=delta))
        return events

    def _call(self, index: int, call_id: str | None, name: str | None,
              arguments: str) -> list[dict[str, Any]]:
        events = []
        if index not in self.calls:
            events += self._add(_function_call(call_id or _new_id("call"), name or "", ""))
            assert self.open is not None
            self.calls[index] = self.open
        out = self.calls[index]
        if arguments:
            self.items[out]["arguments"] += arguments
            events.append(self._event("response.function_call_arguments.delta",
                                      item_id=self.items[out]["id"], output_index=out,
                                      delta=arguments))
        return events

    # -- stream --
    def start(self) -> list[dict[str, Any]]:
        snapshot = self._snapshot("in_progress")
        return [self._event("response.created", response=snapshot),
                self._event("response.in_progress", response=snapshot)]

    def feed(self, chunk: ChatCompletionChunk) -> list[dict[str, Any]]:
        if chunk.usage is not None:
            self.usage = chunk.usage
        events: list[dict[str, Any]] = []
        for choice in chunk.choices[:1]:
            delta = choice.delta
            if delta.reasoning_content:
                events += self._text("reasoning", delta.reasoning_content)
            if delta.content:
                events += self._text("message", delta.content)
            for call in delta.tool_calls or []:
                fn = call.function
                events += self._call(call.index, call.id, fn.name if fn else None,
                                     (fn.arguments if fn else None) or "")
            if choice.finish_reason is not None:
                self.finish_reason = choice.finish_reason
        return events

    def finish(self) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """The final response object, and the events that end the stream."""
        incomplete = self.finish_reason == "length"
        events = self._close("incomplete" if incomplete else "completed")
        if not self.items:  # nothing was generated: an empty message, as OpenAI answers
            events += self._add(_message(""))
            events += self._close("incomplete" if incomplete else "completed")
        response = self._final(incomplete)
        kind = "response.incomplete" if incomplete else "response.completed"
        return response, [*events, self._event(kind, response=response)]

    def fail(self, message: str) -> list[dict[str, Any]]:
        events = self._close("incomplete")  # the open item ends, cut short
        response = ResponseObject.model_validate({
            **self._snapshot("failed"), "error": {"code": "server_error", "message": message},
        }).model_dump(mode="json", by_alias=True)
        return [*events, self._event("response.failed", response=response)]

    def _final(self, incomplete: bool) -> dict[str, Any]:
        final = self._snapshot("incomplete" if incomplete else "completed")
        if incomplete:
            final["incomplete_details"] = {"reason": "max_output_tokens"}
        return ResponseObject.model_validate(final).model_dump(mode="json", by_alias=True)

    # -- whole --
    def whole(self, message: ChatResponseMessage, finish_reason: str | None,
              usage: UsageInfo) -> dict[str, Any]:
        """The response object of a whole chat message."""
        incomplete = finish_reason == "length"
        status = "incomplete" if incomplete else "completed"
        if message.reasoning_content:
            self.items.append(_reasoning(message.reasoning_content, status))
        if message.content or not message.tool_calls:
            self.items.append(_message(message.content or "", status))
        for call in message.tool_calls:
            self.items.append(_function_call(call.id, call.function.name,
                                             call.function.arguments, status))
        self.usage = usage
        return self._final(incomplete)


def _message(text: str, status: str = "in_progress") -> dict[str, Any]:
    return {"type": "message", "id": _new_id("msg"), "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [],
                         "logprobs": []}]}


def _reasoning(text: str, status: str = "in_progress") -> dict[str, Any]:
    return {"type": "reasoning", "id": _new_id("rs"), "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}]}


def _function_call(call_id: str, name: str, arguments: str,
                   status: str = "in_progress") -> dict[str, Any]:
    return {"type": "function_call", "id": _new_id("fc"), "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


def stream_message(items: list[dict[str, Any]]) -> ChatResponseMessage:
    """The chat message a streamed response's items amount to (for the store)."""
    text = "".join(i["content"][0]["text"] for i in items if i["type"] == "message")
    calls = [{"id": i["call_id"], "function": {"name": i["name"], "arguments": i["arguments"]}}
             for i in items if i["type"] == "function_call"]
    return ChatResponseMessage.model_validate({"content": text or None, "tool_calls": calls})


async def _stream(ctx: ServerContext, body: ResponsesRequest, run: ChatRun,
                  events: ResponseEvents, conversation: list[dict[str, Any]]
                  ) -> AsyncIterator[str]:
    try:
        for event in events.start():
            yield _sse(event)
        async for chunk in run.chunks():
            for event in events.feed(chunk):
                yield _sse(event)
        response, last = events.finish()
        if body.store:  # before the last event: a client may retrieve it right away
            _keep(ctx, response, conversation, stream_message(events.items))
        for event in last:
            yield _sse(event)
    except ENGINE_ERRORS as e:
        for event in events.fail(str(e)):
            yield _sse(event)
    finally:
        run.cancel()


def _sse(event: dict[str, Any]) -> str:
    return f"event: {event['type']}\n" + sse(json.dumps(event, ensure_ascii=False))


# ---- the OpenAPI document's answers -----------------------------------------------------------
_NOT_FOUND = {"model": ErrorResponse, "description": "no stored response has this id (never "
              "stored, deleted, or evicted past --max-stored-responses)"}
CREATE_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"model": ResponseObject, "description": "the response, or with `stream: true` "
          "Server-Sent Events (`event: <type>`, `data: <json>`), the last one "
          "response.completed, response.incomplete or response.failed",
          "content": {"text/event-stream": {"schema": {
              "type": "object", "required": ["data"],
              "properties": {"data": {"type": "string"}, "event": {"type": "string"}}}}}},
    404: {"model": ErrorResponse, "description": "the model, or previous_response_id, is not "
          "known here"},
    500: {"model": ErrorResponse, "description": "the model step failed"},
}
RETRIEVE_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"model": ResponseObject, "description": "the stored response"}, 404: _NOT_FOUND}
DELETE_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"model": DeletedResponse, "description": "the response was deleted"},
    404: _NOT_FOUND}
