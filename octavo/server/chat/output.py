"""One chat choice's text -> the assistant message: reasoning, content and tool calls.

The reasoning parser (--reasoning-parser) splits `<think>...</think>` off first; what is left
is content, from which tool calls are read: by the tool-call parser when the model chose
(tool_choice auto), or as the JSON the grammar forced (required / a named function). Streaming
and whole responses go through the same parsers, so the deltas of a stream add up to the
message of the same output.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from octavo.server.chat.reasoning import ReasoningParser
from octavo.server.chat.tool_parsers.base import ToolCall, ToolCallDelta
from octavo.server.chat.tools import ToolPlan, forced_calls
from octavo.server.protocol import ChatResponseMessage, DeltaMessage
from octavo.server.protocol_agent import (
    DeltaFunctionCall,
    DeltaToolCall,
    FunctionCallOut,
    ToolCallOut,
)


def tool_call_out(call: ToolCall) -> ToolCallOut:
    return ToolCallOut(id=call.id, function=FunctionCallOut(name=call.name,
                                                            arguments=call.arguments))


def delta_tool_call(d: ToolCallDelta) -> DeltaToolCall:
    first = d.name is not None
    return DeltaToolCall(index=d.index, id=d.id, type="function" if first else None,
                         function=DeltaFunctionCall(name=d.name, arguments=d.arguments))


def final_message(text: str, plan: ToolPlan, reasoning: ReasoningParser | None
                  ) -> tuple[ChatResponseMessage, bool]:
    """The whole message of an output, and whether it called tools."""
    reasoning_text = None
    content: str | None = text
    if reasoning is not None:
        reasoning_text, content = reasoning.extract(text)
    calls: list[ToolCall] = []
    if plan.forced:
        calls = forced_calls(plan, content or "")
        if calls:
            content = None
    elif plan.mode == "auto" and plan.parser is not None and content:
        extracted = plan.parser.extract_tool_calls(content)
        if extracted.tools_called:
            calls, content = extracted.tool_calls, extracted.content
    message = ChatResponseMessage(content=content, reasoning_content=reasoning_text,
                                  tool_calls=[tool_call_out(c) for c in calls])
    if reasoning is None and not calls and content is None:
        message.content = ""
    return message, bool(calls)


@dataclass
class ChoiceStream:
    """The deltas of one streamed choice."""

    plan: ToolPlan
    reasoning: ReasoningParser | None
    called: bool = False  # a call completed (the finish reason is then "tool_calls")
    _reasoning_stream: object = None
    _tool_stream: object = None
    _forced: _ForcedStream | None = None
    _pending_calls: list[ToolCallDelta] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.reasoning is not None:
            self._reasoning_stream = self.reasoning.stream()
        if self.plan.forced:
            self._forced = _ForcedStream(self.plan)
        elif self.plan.mode == "auto" and self.plan.parser is not None:
            self._tool_stream = self.plan.parser.stream()

    def feed(self, delta: str) -> DeltaMessage | None:
        return self._step(delta, final=False)

    def finish(self) -> DeltaMessage | None:
        return self._step("", final=True)

    def _step(self, delta: str, final: bool) -> DeltaMessage | None:
        reasoning_delta: str | None = None
        content_delta: str | None = delta
        if self._reasoning_stream is not None:
            rs = self._reasoning_stream
            reasoning_delta, content_delta = rs.finish() if final else rs.feed(delta)  # type: ignore[attr-defined]
        calls: list[ToolCallDelta] = []
        content_out = content_delta
        if self._forced is not None:
            calls = self._forced.feed(content_delta or "", final)
            content_out = None
            self.called |= bool(calls)
        elif self._tool_stream is not None:
            ts = self._tool_stream
            if content_delta:
                result = ts.feed(content_delta)  # type: ignore[attr-defined]
                content_out, calls = result.content, list(result.tool_calls)
                self.called |= bool(result.closed)
            else:
                content_out = None
            if final:
                result = ts.finish()  # type: ignore[attr-defined]
                content_out = (content_out or "") + (result.content or "") or None
                calls += result.tool_calls
                self.called |= bool(result.closed)
        if not (reasoning_delta or content_out or calls):
            return None
        return DeltaMessage(reasoning_content=reasoning_delta or None,
                            content=content_out or None,
                            tool_calls=[delta_tool_call(c) for c in calls] or None)


class _ForcedStream:
    """Deltas of a constrained call: a named function's arguments stream as they come; a
    required list's calls each go out once its JSON object is complete."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.text = ""
        self.pos = 0  # required: where the next element starts
        self.index = 0
        self.call: ToolCall | None = None
        self._decoder = json.JSONDecoder()

    def feed(self, delta: str, final: bool) -> list[ToolCallDelta]:
        self.text += delta
        if self.plan.mode == "named":
            return self._named(delta)
        return self._required()

    def _named(self, delta: str) -> list[ToolCallDelta]:
        out = []
        if self.call is None:
            if not self.text.strip():
                return []
            assert self.plan.function is not None
            self.call = ToolCall(name=self.plan.function, arguments="")
            out.append(ToolCallDelta(0, id=self.call.id, name=self.call.name,
                                     arguments=self.text.lstrip()))
        elif delta:
            out.append(ToolCallDelta(0, arguments=delta))
        return out

    def _required(self) -> list[ToolCallDelta]:
        out = []
        while True:
            rest = self.text[self.pos:]
            stripped = rest.lstrip(" \n\t\r[,")
            start = self.pos + len(rest) - len(stripped)
            if not stripped.startswith("{"):
                return out
            try:
                value, end = self._decoder.raw_decode(self.text, start)
            except json.JSONDecodeError:
                return out
            self.pos = end
            if isinstance(value, dict) and "name" in value:
                call = ToolCall(name=value["name"],
                                arguments=json.dumps(value.get("parameters", {}),
                                                     ensure_ascii=False))
                out.append(ToolCallDelta(self.index, id=call.id, name=call.name,
                                         arguments=call.arguments))
                self.index += 1
