"""Strict JSON decoding and tool-call validation shared by the JSON-based formats.

Arguments always leave a parser as `json.dumps(obj, ensure_ascii=False)` of a dict, whatever
the model wrote ("arguments" or "parameters", an object or a JSON-encoded string), so streamed
and non-streamed answers carry the same bytes. NaN and Infinity are rejected: they are not JSON;
so are duplicate keys and lone surrogates, which json.loads would take but which would make the
arguments streamed as they are generated (json_stream.py) differ from the whole call's.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection
from typing import Any

from octavo.server.chat.tool_parsers.scanning import ParsedCall

ARGUMENT_KEYS = ("arguments", "parameters")


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        raise ValueError("duplicate key")
    return obj


_DECODER = json.JSONDecoder(parse_constant=_reject_constant, object_pairs_hook=_unique_keys)


def decode_json_at(text: str, pos: int) -> tuple[Any, int] | None:
    """The JSON value starting exactly at `pos` and the position after it, or None.

    A value that starts with `{` or `[` and decodes on a prefix decodes the same on any longer
    text (its end is its closing bracket), which is what makes streaming decisions safe.
    """
    try:
        return _DECODER.raw_decode(text, pos)
    except (ValueError, RecursionError):
        return None


_CLOSER = re.compile(r"[\]}]")


class JsonDecodeCache:
    """`decode_json_at` for a growing text, re-decoding a failed position only once a `}` or
    `]` has arrived since: a bracketed value that fails on a prefix can only end in new text."""

    def __init__(self) -> None:
        self._failed: dict[int, int] = {}  # position -> text length at its last failure

    def decode_at(self, text: str, pos: int) -> tuple[Any, int] | None:
        seen = self._failed.get(pos)
        if seen is not None and seen <= len(text) and not _CLOSER.search(text, seen):
            self._failed[pos] = len(text)
            return None
        decoded = decode_json_at(text, pos)
        if decoded is None:
            self._failed[pos] = len(text)
        return decoded


def decode_json(text: str) -> tuple[bool, Any]:
    """(True, value) when the whole of `text` (surrounding whitespace aside) is one JSON value."""
    text = text.strip()
    decoded = decode_json_at(text, 0)
    if decoded is None or decoded[1] != len(text):
        return False, None
    return True, decoded[0]


def dump_arguments(arguments: Any) -> str | None:
    """The canonical arguments string of a dict, or None when it is no JSON object."""
    if not isinstance(arguments, dict):
        return None
    try:
        dumped = json.dumps(arguments, ensure_ascii=False, allow_nan=False)
        dumped.encode("utf-8")  # a lone surrogate is no text a client can receive
    except (TypeError, ValueError, RecursionError):
        return None
    return dumped


def call_from_object(obj: Any, allowed_keys: Collection[str] | None = None) -> ParsedCall | None:
    """A call from `{"name": ..., "arguments" | "parameters": {...}}`, or None if it is not one.

    Missing or null arguments mean `{}`; a string holding a JSON object is accepted too. With
    `allowed_keys`, an object with any other key is not a call (guards formats without markers
    against ordinary JSON answers that happen to have a "name").
    """
    if not isinstance(obj, dict):
        return None
    if allowed_keys is not None and not set(obj) <= set(allowed_keys):
        return None
    name = obj.get("name")
    if not isinstance(name, str) or not name.strip():
        return None
    if all(k in obj for k in ARGUMENT_KEYS):
        return None  # which one would be the arguments?
    arguments: Any = next((obj[k] for k in ARGUMENT_KEYS if k in obj), None)
    if arguments is None:
        arguments = {}
    elif isinstance(arguments, str):
        ok, arguments = decode_json(arguments)
        if not ok:
            return None
    dumped = dump_arguments(arguments)
    return None if dumped is None else ParsedCall(name.strip(), dumped)
