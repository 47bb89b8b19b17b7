"""Tool-call parsing results, the parser interface, and the streaming state built on it.

A `ToolParser` turns a model's raw output into OpenAI tool calls (vLLM's
`--tool-call-parser`). Each format supplies a `Scanner` (see scanning.py); this module runs it
over a whole output (`extract_tool_calls`) or over deltas (`ToolCallStream`), with the same
content rule in both: content is the text outside tool calls, stripped of surrounding
whitespace, None when nothing is left. A call is streamed only once it is complete and valid, in
one delta carrying index, id, name and the whole arguments string, so a call that never completes
is never announced: it ends up as content.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar
from uuid import uuid4

from octavo.server.chat.tool_parsers.scanning import ParsedCall, Scanner
from octavo.server.stream_trim import StripTrimmer


def default_call_id() -> str:
    """An OpenAI-style tool call id: "call_" and 24 hex digits."""
    return f"call_{uuid4().hex[:24]}"


@dataclass
class ToolCall:
    """One tool call; `arguments` is a JSON object as a string (json.dumps of a dict)."""

    name: str
    arguments: str
    id: str = field(default_factory=default_call_id)


@dataclass
class ExtractedToolCalls:
    """A whole output parsed: its tool calls and the content outside them (None if blank)."""

    tools_called: bool
    tool_calls: list[ToolCall]
    content: str | None


@dataclass
class ToolCallDelta:
    """A streamed piece of the tool call at `index` (OpenAI's `delta.tool_calls[]` entry)."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str | None = None


@dataclass
class DeltaResult:
    """What one streamed step adds: a content delta (None if none) and tool-call deltas."""

    content: str | None = None
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


class ToolCallStream:
    """Per-choice streaming state: feed output deltas, then `finish()` once generation ends.

    Plain text comes out as soon as it cannot be the start of a tool-call marker; calls come
    out, numbered 0, 1, 2, ..., as soon as they are complete. Concatenating everything equals
    `extract_tool_calls` of the whole text (ids aside).
    """

    def __init__(self, scanner: Scanner, new_call_id: Callable[[], str]) -> None:
        self._scanner = scanner
        self._new_call_id = new_call_id
        self._text = ""
        self._pos = 0
        self._index = 0
        self._content = StripTrimmer()
        self._finished = False

    def feed(self, delta_text: str) -> DeltaResult:
        if self._finished:
            raise RuntimeError("feed() after finish()")
        self._text += delta_text
        return self._advance(final=False)

    def finish(self) -> DeltaResult:
        """Flush held-back text; an incomplete or malformed call becomes content."""
        if self._finished:
            return DeltaResult()
        result = self._advance(final=True)
        self._finished = True
        return result

    def _advance(self, final: bool) -> DeltaResult:
        content: list[str] = []
        deltas: list[ToolCallDelta] = []
        while self._pos < len(self._text):
            step = self._scanner.step(self._text, self._pos, final)
            if step is None:
                if final:
                    raise RuntimeError("tool-call scanner undecided at end of output")
                break
            segments, end = step
            if end <= self._pos:
                raise RuntimeError("tool-call scanner did not advance")
            self._pos = end
            for segment in segments:
                if isinstance(segment, str):
                    content.append(self._content.push(segment))
                else:
                    deltas.append(ToolCallDelta(self._index, self._new_call_id(),
                                                segment.name, segment.arguments))
                    self._index += 1
        return DeltaResult("".join(content) or None, deltas)


class ToolParser(ABC):
    """One tool-call output format: whole-output extraction, streaming and a teaching prompt."""

    name: ClassVar[str]

    @abstractmethod
    def scanner(self) -> Scanner:
        """A fresh scanner for one output."""

    @abstractmethod
    def system_prompt(self, tools: list[dict]) -> str:
        """Text that teaches a model this format and lists `tools` (OpenAI tool dicts) as JSON.

        For chat templates that do not render `tools` themselves.
        """

    def new_call_id(self) -> str:
        """The id given to each parsed call (formats with their own id shape override it)."""
        return default_call_id()

    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        """Parse a whole output at once."""
        scanner = self.scanner()
        parts: list[str] = []
        calls: list[ToolCall] = []
        pos = 0
        while pos < len(text):
            step = scanner.step(text, pos, True)
            if step is None or step[1] <= pos:
                raise RuntimeError("tool-call scanner did not advance at end of output")
            segments, pos = step
            for segment in segments:
                if isinstance(segment, ParsedCall):
                    calls.append(ToolCall(segment.name, segment.arguments, self.new_call_id()))
                else:
                    parts.append(segment)
        return ExtractedToolCalls(bool(calls), calls, "".join(parts).strip() or None)

    def stream(self) -> ToolCallStream:
        """A fresh streaming state for one choice."""
        return ToolCallStream(self.scanner(), self.new_call_id)
