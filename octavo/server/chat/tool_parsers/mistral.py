"""Mistral tool calls: `[TOOL_CALLS]` then a JSON list `[{"name": ..., "arguments": {...}}]`.

The newer form (tokenizer v11+) is also read: `[TOOL_CALLS]name[ARGS]{...}`, one marker per
call. Text outside the calls is content. After a marker that is not followed by a well-formed
call (or list of calls) the marker stays in the content verbatim and scanning resumes after it.
Ids are 9 alphanumeric characters, the only shape Mistral's chat templates accept.
"""

from __future__ import annotations

import re
import secrets
import string
from typing import Any

from octavo.server.chat.tool_parsers.base import ToolParser
from octavo.server.chat.tool_parsers.calls import JsonDecodeCache, call_from_object, dump_arguments
from octavo.server.chat.tool_parsers.json_stream import CallStreams, partial_calls
from octavo.server.chat.tool_parsers.prompting import tools_as_json_lines
from octavo.server.chat.tool_parsers.scanning import (
    ParsedCall,
    PartialCall,
    Scanner,
    Step,
    held_back_len,
    skip_ws,
    text_until_marker,
)

MARKER = "[TOOL_CALLS]"
ARGS = "[ARGS]"
_NAME = re.compile(r"[A-Za-z0-9_.\-]+")
_NAME_CHARS = re.compile(r"[A-Za-z0-9_.\-]*")
_ID_ALPHABET = string.ascii_letters + string.digits


def _calls_from_json(value: Any) -> list[ParsedCall] | None:
    items = value if isinstance(value, list) else [value]
    calls = [call_from_object(item) for item in items]
    if not calls or any(c is None for c in calls):
        return None
    return [c for c in calls if c is not None]


class _MistralScanner(Scanner):
    def __init__(self) -> None:
        self._json = JsonDecodeCache()
        self._calls = CallStreams()

    def partial(self, text: str, pos: int) -> list[PartialCall]:
        """A list of call objects, one call object, or `name[ARGS]` and its arguments."""
        if not text.startswith(MARKER, pos):
            return []  # the text waits on what may become a marker
        p = skip_ws(text, pos + len(MARKER))
        if p == len(text):
            return []
        if text[p] in "[{":
            return partial_calls(self._calls.at(text, p, 1 if text[p] == "[" else 0))
        args_at = text.find(ARGS, p)
        name = text[p:args_at]
        if args_at < 0 or not _NAME.fullmatch(name):
            return []
        q = skip_ws(text, args_at + len(ARGS))
        if q == len(text) or text[q] != "{":
            return []
        stream = self._calls.at(text, q, None)
        return [] if stream.failed else [PartialCall(name, stream.out())]

    def step(self, text: str, pos: int, final: bool) -> Step | None:
        if not text.startswith(MARKER, pos):
            return text_until_marker(text, pos, (MARKER,), final)
        after = pos + len(MARKER)
        malformed: Step = ([MARKER], after)
        p = skip_ws(text, after)
        if p == len(text):
            return malformed if final else None
        if text[p] in "[{":
            decoded = self._json.decode_at(text, p)
            if decoded is None:
                return malformed if final else None
            calls = _calls_from_json(decoded[0])
            return (list(calls), decoded[1]) if calls else malformed
        return self._named_call(text, p, final, malformed)

    def _named_call(self, text: str, p: int, final: bool, malformed: Step) -> Step | None:
        """`name[ARGS]{...}` starting at `p`."""
        args_at = text.find(ARGS, p)
        if args_at < 0:
            if final:
                return malformed
            tail = text[p:len(text) - held_back_len(text[p:], ARGS)]
            return None if _NAME_CHARS.fullmatch(tail) else malformed
        name = text[p:args_at]
        if not _NAME.fullmatch(name):
            return malformed
        q = skip_ws(text, args_at + len(ARGS))
        decoded = self._json.decode_at(text, q) if q < len(text) and text[q] == "{" else None
        if decoded is None:
            return malformed if final or (q < len(text) and text[q] != "{") else None
        arguments = dump_arguments(decoded[0])
        return ([ParsedCall(name, arguments)], decoded[1]) if arguments else malformed


class MistralToolParser(ToolParser):
    """vLLM's "mistral" parser (Mistral 7B v0.3, Nemo, Small, Large and their relatives)."""

    name = "mistral"

    def scanner(self) -> Scanner:
        return _MistralScanner()

    def new_call_id(self) -> str:
        return "".join(secrets.choice(_ID_ALPHABET) for _ in range(9))

    def system_prompt(self, tools: list[dict]) -> str:
        return (
            "You have access to the following functions, described as JSON:\n"
            f"{tools_as_json_lines(tools)}\n\n"
            "To call one or more functions, respond with [TOOL_CALLS] followed by a JSON list "
            "of calls and nothing else:\n"
            '[TOOL_CALLS][{"name": <function-name>, "arguments": <args-json-object>}, ...]\n'
            "Otherwise answer the user normally."
        )
