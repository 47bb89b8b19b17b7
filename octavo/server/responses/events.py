"""Chat output -> the Responses API's output items and streaming events.

ResponseEvents turns a chat stream's chunks (or a whole chat response) into the response
object's `output` items (reasoning, message, function_call) and the numbered events of a
Responses stream (response.created ... response.completed / incomplete / failed).
"""

from __future__ import annotations

import copy
import uuid
from typing import Any

from octavo.server.protocol import ChatCompletionChunk, ChatResponseMessage, UsageInfo
from octavo.server.responses.protocol import InputTokensDetails, ResponseObject, ResponseUsage


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _usage(u: UsageInfo | None) -> dict[str, Any] | None:
    if u is None:
        return None
    cached = u.prompt_tokens_details.cached_tokens if u.prompt_tokens_details else 0
    return ResponseUsage(input_tokens=u.prompt_tokens, output_tokens=u.completion_tokens,
                         total_tokens=u.total_tokens,
                         input_tokens_details=InputTokensDetails(cached_tokens=cached)
                         ).model_dump()


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
            events += self._add(_function_call(call_id or new_id("call"), name or "", ""))
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
    return {"type": "message", "id": new_id("msg"), "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [],
                         "logprobs": []}]}


def _reasoning(text: str, status: str = "in_progress") -> dict[str, Any]:
    return {"type": "reasoning", "id": new_id("rs"), "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}]}


def _function_call(call_id: str, name: str, arguments: str,
                   status: str = "in_progress") -> dict[str, Any]:
    return {"type": "function_call", "id": new_id("fc"), "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


def stream_message(items: list[dict[str, Any]]) -> ChatResponseMessage:
    """The chat message a streamed response's items amount to (for the store)."""
    text = "".join(i["content"][0]["text"] for i in items if i["type"] == "message")
    calls = [{"id": i["call_id"], "function": {"name": i["name"], "arguments": i["arguments"]}}
             for i in items if i["type"] == "function_call"]
    return ChatResponseMessage.model_validate({"content": text or None, "tool_calls": calls})


