"""Tool-call parsing results, the parser interface, and the streaming state built on it.

A `ToolParser` turns a model's raw output into OpenAI tool calls (vLLM's
`--tool-call-parser`). Each format supplies a `Scanner` (see scanning.py); this module runs it
over a whole output (`extract_tool_calls`) or over deltas (`ToolCallStream`), with the same
content rule in both: content is the text outside tool calls, stripped of surrounding
whitespace, None when nothing is left.

A whole output's calls are those that are complete and valid. A stream announces a call as
soon as its scanner knows its name and where its arguments object begins (`Scanner.partial`),
then sends its arguments as they are generated, in the canonical form the whole output's
arguments have, so for every call that completes the deltas add up to exactly the extracted
arguments. A call that is announced and then never completes validly (the output stops in it,
or it turns out malformed) is "broken": it keeps what was sent, and the stream goes on as the
whole output reads, its text becoming content there. Formats whose scanner cannot tell
(pythonic), and calls written arguments first, are sent whole once complete.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar
from uuid import uuid4

from octavo.server.chat.tool_parsers.scanning import ParsedCall, PartialCall, Scanner
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
    """What one streamed step adds: a content delta (None if none), tool-call deltas, and the
    indices of the calls that completed (`closed`) or broke (`broken`) in it."""

    content: str | None = None
    tool_calls: list[ToolCallDelta] = field(default_factory=list)
    closed: list[int] = field(default_factory=list)
    broken: list[int] = field(default_factory=list)


@dataclass
class _Announced:
    """A call sent before it completed: its index, name and the arguments sent so far."""

    index: int
    name: str
    sent: str


class ToolCallStream:
    """Per-choice streaming state: feed output deltas, then `finish()` once generation ends.

    Plain text comes out as soon as it cannot be the start of a tool-call marker; calls are
    numbered 0, 1, 2, ... in order, announced as soon as their name is known and their
    arguments streamed as they come (or sent whole once complete, where the format cannot
    tell). Concatenating everything equals `extract_tool_calls` of the whole text (ids aside),
    broken calls aside.
    """

    def __init__(self, scanner: Scanner, new_call_id: Callable[[], str]) -> None:
        self._scanner = scanner
        self._new_call_id = new_call_id
        self._text = ""
        self._pos = 0
        self._index = 0
        self._content = StripTrimmer()
        self._finished = False
        self._pending: list[_Announced] = []  # calls announced at self._pos

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
        result = DeltaResult()
        while self._pos < len(self._text):
            step = self._scanner.step(self._text, self._pos, final)
            if step is None:
                if final:
                    raise RuntimeError("tool-call scanner undecided at end of output")
                self._announce(self._scanner.partial(self._text, self._pos), result)
                break
            segments, end = step
            if end <= self._pos:
                raise RuntimeError("tool-call scanner did not advance")
            self._pos = end
            pending, self._pending = self._pending, []
            for segment in segments:
                if isinstance(segment, str):
                    content.append(self._content.push(segment))
                else:
                    self._complete(segment, pending, result)
            result.broken += [a.index for a in pending]  # announced, never completed
        result.content = "".join(content) or None
        return result

    def _complete(self, call: ParsedCall, pending: list[_Announced], result: DeltaResult
                  ) -> None:
        """A decided call: the rest of an announced one, or a new one sent whole."""
        announced = pending.pop(0) if pending else None
        if (announced is not None and announced.name == call.name
                and call.arguments.startswith(announced.sent)):
            rest = call.arguments[len(announced.sent):]
            if rest:
                result.tool_calls.append(ToolCallDelta(announced.index, arguments=rest))
            result.closed.append(announced.index)
            return
        if announced is not None:  # the scanner broke its promise: never send it again
            result.broken.append(announced.index)
        result.tool_calls.append(ToolCallDelta(self._index, self._new_call_id(), call.name,
                                               call.arguments))
        result.closed.append(self._index)
        self._index += 1

    def _announce(self, partials: list[PartialCall], result: DeltaResult) -> None:
        for i, p in enumerate(partials):
            if i == len(self._pending):
                a = _Announced(self._index, p.name, p.arguments)
                self._pending.append(a)
                self._index += 1
                result.tool_calls.append(ToolCallDelta(a.index, self._new_call_id(), p.name,
                                                       p.arguments))
                continue
            a = self._pending[i]
            if p.name == a.name and len(p.arguments) > len(a.sent) \
                    and p.arguments.startswith(a.sent):
                result.tool_calls.append(ToolCallDelta(a.index,
                                                       arguments=p.arguments[len(a.sent):]))
                a.sent = p.arguments


class ToolParser(ABC):
    """One tool-call output format: whole-output extraction, streaming and a teaching prompt.

    `tools`: the request's tools (OpenAI tool dicts), for formats whose arguments are typed by
    the tools' schemas (qwen3_coder writes every argument as text)."""

    name: ClassVar[str]

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        self.tools = tools or []

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
