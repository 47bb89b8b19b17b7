"""A JSON value's canonical text, written while its raw text is still being generated.

Tool-call arguments leave the parsers as `json.dumps(value, ensure_ascii=False)` whatever
spacing and escapes the model wrote (calls.py), so a streamed call's argument deltas cannot
simply be the model's text: they would not add up to the arguments of the same output
extracted whole. `JsonStream` reads the raw text one character at a time and writes, as soon
as it is certain, the canonical text of what it read: punctuation with json.dumps' separators,
strings character by character (escapes decoded and re-escaped as json.dumps does), numbers
and literals once they end. What it wrote is always a prefix of the canonical text of the
whole value, provided the value completes and is valid: it refuses what the strict decoder of
calls.py refuses (duplicate keys, lone surrogates, NaN, infinities, anything that is not JSON).

It also notes the tool calls inside the value: objects at a given nesting level (the value
itself, or the elements of a list of calls) with their "name" and where in the written text
their "arguments" (or "parameters") object starts and ends.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field

from octavo.server.chat.tool_parsers.calls import ARGUMENT_KEYS
from octavo.server.chat.tool_parsers.scanning import PartialCall

_WS = " \t\n\r"
_NUMBER_CHARS = frozenset("0123456789+-.eE")
_NUMBER = re.compile(r"-?(?:0|[1-9]\d*)(\.\d+)?([eE][-+]?\d+)?")
_LITERALS = {"true": "true", "false": "false", "null": "null"}
_SIMPLE_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r",
                   "t": "\t"}
_DUMPS_ESCAPES = {'"': '\\"', "\\": "\\\\", "\n": "\\n", "\r": "\\r", "\t": "\\t", "\b": "\\b",
                  "\f": "\\f"}
MAX_DEPTH = 128  # deeper values stream no further; the end of the call still sends the rest


def escape_char(c: str) -> str:
    """One character as json.dumps(..., ensure_ascii=False) writes it inside a string."""
    e = _DUMPS_ESCAPES.get(c)
    if e is not None:
        return e
    return f"\\u{ord(c):04x}" if c < " " else c


@dataclass
class CallRecord:
    """A call object seen so far: its name, and its arguments object's span in the text."""

    keys: set[str] = field(default_factory=set)
    name: str | None = None  # the decoded "name" string, once closed
    name_first: bool = False  # the name came before the arguments began
    args_start: int | None = None  # where the arguments object starts in the written text
    args_end: int | None = None  # just after it, once it closed
    args_object: bool = False  # the argument key's value is an object (not a string)

    def announceable(self, allowed_keys: frozenset[str] | None = None) -> bool:
        """Named before its arguments, which are an object that began, by one argument key."""
        return (self.name_first and self.args_object and self.args_start is not None
                and bool(self.name and self.name.strip())
                and len(self.keys & set(ARGUMENT_KEYS)) == 1
                and (allowed_keys is None or self.keys <= allowed_keys))


class _Container:
    __slots__ = ("kind", "phase", "keys", "key", "record", "args_of")

    def __init__(self, kind: str, phase: str, record: CallRecord | None = None) -> None:
        self.kind = kind  # "o" object, "a" array
        self.phase = phase
        self.keys: set[str] = set()
        self.key: str | None = None  # the key whose value comes next (objects)
        self.record = record  # the call this object is
        self.args_of: CallRecord | None = None  # the call whose arguments this object holds


class JsonStream:
    """The canonical text of the JSON value starting at `start`, read as its text grows.

    `feed(text)` reads what arrived since the last call (`text` only ever grows). Then `out()`
    is the canonical text so far; `done` once the value closed (`end` is just after it);
    `failed` once it cannot be JSON. `call_level`: the nesting level of call objects (0: the
    value, 1: the elements of a list), or None to record no calls.
    """

    def __init__(self, start: int, call_level: int | None = None) -> None:
        self.pos = start
        self.end: int | None = None
        self.failed = False
        self.frozen = False  # too deep to follow: writes nothing more
        self.calls: list[CallRecord] = []
        self._call_level = call_level
        self._out: list[str] = []
        self._len = 0
        self._joined = ""
        self._stack: list[_Container] = []
        self._started = False
        # a scalar in progress
        self._string: list[str] | None = None  # decoded characters of an open string
        self._string_is_key = False
        self._escape: str | None = None  # an escape read so far, from its backslash
        self._high: int | None = None  # a high surrogate waiting for its low half
        self._number: str | None = None
        self._literal: str | None = None

    @property
    def done(self) -> bool:
        return self.end is not None

    def out(self) -> str:
        if len(self._joined) != self._len:
            self._joined = "".join(self._out)
            self._out = [self._joined]
        return self._joined

    def _write(self, s: str) -> None:
        self._out.append(s)
        self._len += len(s)

    # ---- reading -----------------------------------------------------------------------------
    def feed(self, text: str) -> None:
        while self.pos < len(text) and not (self.done or self.failed or self.frozen):
            if not self._char(text[self.pos]):
                self.failed = True
                return
            if self.end is None:
                self.pos += 1

    def _char(self, c: str) -> bool:
        if self._string is not None:
            return self._string_char(c)
        if self._number is not None:
            if c in _NUMBER_CHARS:
                self._number += c
                return True
            if not self._end_number():
                return False
            if self.end is not None:
                return True
        if self._literal is not None:
            self._literal += c
            if self._literal in _LITERALS:
                self._write(_LITERALS[self._literal])
                self._literal = None
                return self._value_done(self.pos + 1)
            return any(lit.startswith(self._literal) for lit in _LITERALS)
        return self._structural(c)

    def _structural(self, c: str) -> bool:
        if c in _WS:
            return True
        top = self._stack[-1] if self._stack else None
        if top is None or top.phase in ("value", "value_or_end"):
            if top is None and self._started:
                return False
            if top is not None and top.phase == "value_or_end" and c == "]":
                self._write("]")
                self._stack.pop()
                return self._value_done(self.pos + 1)
            return self._value_start(c, top)
        if top.kind == "o":
            if top.phase in ("key_or_end", "key") and c == '"':
                self._string, self._string_is_key = [], True
                self._write('"')
                return True
            if top.phase in ("key_or_end", "comma_or_end") and c == "}":
                return self._close_object()
            if top.phase == "colon" and c == ":":
                self._write(": ")
                top.phase = "value"
                return True
            if top.phase == "comma_or_end" and c == ",":
                self._write(", ")
                top.phase = "key"
                return True
            return False
        if top.phase == "comma_or_end":
            if c == ",":
                self._write(", ")
                top.phase = "value"
                return True
            if c == "]":
                self._write("]")
                self._stack.pop()
                return self._value_done(self.pos + 1)
        return False

    def _value_start(self, c: str, parent: _Container | None) -> bool:
        self._started = True
        key = parent.key if parent is not None and parent.kind == "o" else None
        record = parent.record if parent is not None else None
        if c == "{":
            if len(self._stack) >= MAX_DEPTH:
                self.frozen = True
                return True
            level = len(self._stack)
            is_call = self._call_level is not None and level == self._call_level
            child = _Container("o", "key_or_end", CallRecord() if is_call else None)
            if child.record is not None:
                self.calls.append(child.record)
            if record is not None and key in ARGUMENT_KEYS:
                record.args_object = True
                record.args_start = self._len
                record.name_first = record.name is not None
                child.args_of = record
            self._stack.append(child)
            self._write("{")
            return True
        if c == "[":
            if len(self._stack) >= MAX_DEPTH:
                self.frozen = True
                return True
            self._stack.append(_Container("a", "value_or_end"))
            self._write("[")
            return True
        if c == '"':
            self._string, self._string_is_key = [], False
            self._write('"')
            return True
        if c == "-" or c.isdigit():
            self._number = c
            return True
        if c in "tfn":
            self._literal = c
            return True
        return False

    def _close_object(self) -> bool:
        obj = self._stack.pop()
        self._write("}")
        if obj.args_of is not None:
            obj.args_of.args_end = self._len
        return self._value_done(self.pos + 1)

    def _value_done(self, after: int) -> bool:
        """A value ended; `after`: the text position just after it."""
        if not self._stack:
            self.end = after
            return True
        top = self._stack[-1]
        top.phase = "comma_or_end"
        top.key = None
        return True

    def _end_number(self) -> bool:
        raw, self._number = self._number or "", None
        match = _NUMBER.fullmatch(raw)
        if match is None:
            return False
        if match.group(1) is None and match.group(2) is None:
            try:
                text = str(int(raw))
            except ValueError:  # beyond int's digit limit: json.loads refuses it too
                return False
        else:
            value = float(raw)
            if math.isinf(value):
                return False
            text = repr(value)
        self._write(text)
        # a number ends at the character after it, which is read next (not consumed here)
        top = self._stack[-1] if self._stack else None
        if top is None:
            self.end = self.pos
            return True
        top.phase = "comma_or_end"
        top.key = None
        return True

    # ---- strings -----------------------------------------------------------------------------
    def _string_char(self, c: str) -> bool:
        if self._escape is not None:
            self._escape += c
            return self._escape_char()
        if self._high is not None:  # a high surrogate must be followed by \uDC00-\uDFFF
            if c != "\\":
                return False
            self._escape = c
            return True
        if c == "\\":
            self._escape = c
            return True
        if c == '"':
            return self._end_string()
        if c < " ":
            return False  # a raw control character (json.loads' strict mode refuses it)
        self._decoded(c)
        return True

    def _escape_char(self) -> bool:
        e = self._escape or ""
        if len(e) == 2 and e[1] != "u":
            if self._high is not None:
                return False
            plain = _SIMPLE_ESCAPES.get(e[1])
            if plain is None:
                return False
            self._escape = None
            self._decoded(plain)
            return True
        if len(e) > 2 and e[-1] not in "0123456789abcdefABCDEF":
            return False
        if len(e) < 6:
            return True
        code = int(e[2:], 16)
        self._escape = None
        if self._high is not None:
            if not 0xDC00 <= code <= 0xDFFF:
                return False  # a lone high surrogate: not encodable text
            code = 0x10000 + ((self._high - 0xD800) << 10) + (code - 0xDC00)
            self._high = None
        elif 0xD800 <= code <= 0xDBFF:
            self._high = code
            return True
        elif 0xDC00 <= code <= 0xDFFF:
            return False
        self._decoded(chr(code))
        return True

    def _decoded(self, c: str) -> None:
        assert self._string is not None
        self._string.append(c)
        self._write(escape_char(c))

    def _end_string(self) -> bool:
        text = "".join(self._string or [])
        self._string = None
        self._write('"')
        top = self._stack[-1] if self._stack else None
        if self._string_is_key:
            assert top is not None
            if text in top.keys:
                return False  # a duplicate key (calls.py refuses them)
            top.keys.add(text)
            top.key = text
            top.phase = "colon"
            if top.record is not None:
                top.record.keys.add(text)
            return True
        if top is not None and top.record is not None and top.key == "name":
            top.record.name = text
        return self._value_done(self.pos + 1)


class CallStreams:
    """The JsonStream of the call a scanner waits on, by where its JSON starts (one at a
    time: a scanner waits on one position until it decides it)."""

    def __init__(self) -> None:
        self._start = -1
        self._stream: JsonStream | None = None

    def at(self, text: str, start: int, call_level: int | None) -> JsonStream:
        if self._stream is None or self._start != start:
            self._start, self._stream = start, JsonStream(start, call_level)
        self._stream.feed(text)
        return self._stream


def partial_calls(stream: JsonStream, allowed_keys: frozenset[str] | None = None
                  ) -> list[PartialCall]:
    """The calls of `stream`, in order, up to the first that cannot be announced yet."""
    if stream.failed:
        return []
    out = stream.out()
    calls = []
    for record in stream.calls:
        if not record.announceable(allowed_keys):
            break
        assert record.name is not None and record.args_start is not None
        end = record.args_end if record.args_end is not None else len(out)
        calls.append(PartialCall(record.name.strip(), out[record.args_start:end]))
        if record.args_end is None:
            break
    return calls


def dumps(value: object) -> str:
    """The canonical text the streams above write (calls.py's arguments)."""
    return json.dumps(value, ensure_ascii=False, allow_nan=False)
