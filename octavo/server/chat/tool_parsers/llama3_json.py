"""Llama 3.x JSON tool calls: `<|python_tag|>{"name": ..., "parameters": {...}}`.

The output either starts (after whitespace) with `{`, or has `<|python_tag|>` (whatever precedes
the tag is content). Then come call objects separated by `;`. Objects may say "arguments" instead
of "parameters"; any other key (bar "type") means the object is an ordinary JSON answer, not a
call. Calls are read in sequence; from the first text that does not continue it (anything but
`;` and another call object), everything is content. A trailing `;` is dropped.
"""

from __future__ import annotations

from octavo.server.chat.tool_parsers.base import ToolParser
from octavo.server.chat.tool_parsers.calls import JsonDecodeCache, call_from_object
from octavo.server.chat.tool_parsers.json_stream import CallStreams, partial_calls
from octavo.server.chat.tool_parsers.prompting import tools_as_json_lines
from octavo.server.chat.tool_parsers.scanning import (
    ParsedCall,
    PartialCall,
    Scanner,
    Step,
    skip_ws,
    text_until_marker,
)

TAG = "<|python_tag|>"
_KEYS = ("name", "parameters", "arguments", "type")
_ALLOWED = frozenset(_KEYS)
_MALFORMED = "malformed"


def _call_at(cache: JsonDecodeCache, text: str, p: int,
             final: bool) -> tuple[ParsedCall, int] | str | None:
    """The call object at `p`: (call, end), `_MALFORMED`, or None when more text is needed."""
    decoded = cache.decode_at(text, p) if text[p] == "{" else None
    if decoded is None:
        return _MALFORMED if final or text[p] != "{" else None
    call = call_from_object(decoded[0], _KEYS)
    return (call, decoded[1]) if call else _MALFORMED


class _Llama3JsonScanner(Scanner):
    def __init__(self) -> None:
        self._mode = "start"  # start -> text | calls; calls -> text
        self._json = JsonDecodeCache()
        self._calls = CallStreams()

    def partial(self, text: str, pos: int) -> list[PartialCall]:
        """The call object the scanner waits on: at the start, after the tag, or after `;`."""
        p = skip_ws(text, pos)
        if self._mode == "calls":
            if not text.startswith(";", p):
                return []
            p = skip_ws(text, p + 1)
        elif self._mode == "text":
            if not text.startswith(TAG, pos):
                return []
            p = skip_ws(text, pos + len(TAG))
        if p == len(text) or text[p] != "{":
            return []
        return partial_calls(self._calls.at(text, p, 0), _ALLOWED)

    def step(self, text: str, pos: int, final: bool) -> Step | None:
        if self._mode == "start":
            return self._start(text, pos, final)
        if self._mode == "calls":
            return self._after_call(text, pos, final)
        return self._text(text, pos, final)

    def _start(self, text: str, pos: int, final: bool) -> Step | None:
        p = skip_ws(text, pos)
        if p == len(text):
            return ([text[pos:]], p) if final else None
        if text[p] == "{":
            found = _call_at(self._json, text, p, final)
            if found is None:
                return None
            if not isinstance(found, str):
                self._mode = "calls"
                return [text[pos:p], found[0]], found[1]
        self._mode = "text"
        return self._text(text, pos, final)

    def _text(self, text: str, pos: int, final: bool) -> Step | None:
        if not text.startswith(TAG, pos):
            return text_until_marker(text, pos, (TAG,), final)
        p = skip_ws(text, pos + len(TAG))
        if p == len(text):
            found: tuple[ParsedCall, int] | str | None = _MALFORMED if final else None
        else:
            found = _call_at(self._json, text, p, final)
        if found is None:
            return None
        if isinstance(found, str):
            return [TAG], pos + len(TAG)
        self._mode = "calls"
        return [found[0]], found[1]

    def _after_call(self, text: str, pos: int, final: bool) -> Step | None:
        p = skip_ws(text, pos)
        if p == len(text):
            return ([text[pos:]], p) if final else None
        if text[p] == ";":
            q = skip_ws(text, p + 1)
            if q == len(text):
                return ([], q) if final else None
            found = _call_at(self._json, text, q, final)
            if found is None:
                return None
            if not isinstance(found, str):
                return [found[0]], found[1]
        self._mode = "text"
        return self._text(text, pos, final)


class Llama3JsonToolParser(ToolParser):
    """vLLM's "llama3_json" parser (Llama 3.1 / 3.2 / 3.3 with JSON tool calling)."""

    name = "llama3_json"

    def scanner(self) -> Scanner:
        return _Llama3JsonScanner()

    def system_prompt(self, tools: list[dict]) -> str:
        return (
            "Given the following functions, please respond with a JSON for a function call "
            "with its proper arguments that best answers the given prompt.\n\n"
            'Respond in the format {"name": function name, "parameters": dictionary of '
            "argument name and its value}. Do not use variables. To call several functions, "
            "separate the JSON objects with ';'. If no function is needed, answer normally.\n\n"
            f"{tools_as_json_lines(tools)}"
        )
