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

import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from octavo.server.chat.serving import ChatRun, start_chat
from octavo.server.context import ServerContext
from octavo.server.errors import OpenAIError, bad_request
from octavo.server.protocol import (
    ChatCompletionRequest,
    ChatResponseMessage,
    ErrorResponse,
)
from octavo.server.responses.events import ResponseEvents, new_id, stream_message
from octavo.server.responses.protocol import (
    DeletedResponse,
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionToolChoice,
    MessageItem,
    ResponseObject,
    ResponsesRequest,
    TextPart,
)
from octavo.server.responses.store import StoredResponse, store_of
from octavo.server.serving_common import ENGINE_ERRORS, SSEResponse, client_closed, sse

# chat's parameter names -> the Responses API's, in the errors of the chat layer
_PARAMS = {"messages": "input", "max_tokens": "max_output_tokens",
           "max_completion_tokens": "max_output_tokens", "response_format": "text.format"}


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
    response_id = new_id("resp")
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
