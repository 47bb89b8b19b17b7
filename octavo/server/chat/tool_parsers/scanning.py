"""The scanning protocol every tool-call format implements, and text helpers for markers.

A parser splits model output into segments: plain text (content) and parsed tool calls. A
`Scanner` decides one step at a time, from a position, looking only at the text seen so far.
Both `extract_tool_calls` (the whole output, `final=True`) and streaming (a growing buffer,
`final=False` until the end) drive the same scanner, so they agree as long as every decision a
scanner takes on a prefix is the one it would take on any longer text. A scanner that cannot
decide yet returns None and is asked again, from the same position, when more text arrives.

While it waits on a tool call, `partial` tells what of it is already certain (its name and
the beginning of its arguments), so streaming can send arguments as they are generated.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import NamedTuple


class ParsedCall(NamedTuple):
    """A validated tool call, before it is given an id: arguments are a JSON object string."""

    name: str
    arguments: str


class PartialCall(NamedTuple):
    """A call still being generated: its name and a prefix of its final arguments string."""

    name: str
    arguments: str


Segment = str | ParsedCall
Step = tuple[list[Segment], int]  # decided segments, position just after them


class Scanner(ABC):
    """Per-output state of one format's parser (a fresh one per output or streamed choice).

    `step(text, pos, final)` returns the segments starting at `pos` and the position after
    them, which must be greater than `pos`; or None when more text is needed (never when
    `final`). Internal state may change only by decisions that hold for every extension of
    `text`, or as a pure cache.
    """

    @abstractmethod
    def step(self, text: str, pos: int, final: bool) -> Step | None: ...

    def partial(self, text: str, pos: int) -> list[PartialCall]:
        """The calls begun at `pos` that `step` could not decide yet (it just returned None
        there), in order, as far as they are certain: if `step` later decides calls at `pos`,
        its first ones have these names and arguments that start with these. Each call's
        entry only grows as `text` grows. Formats that cannot tell return none."""
        return []


def held_back_len(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`.

    That suffix may still grow into the marker, so streaming holds it back (like stop strings).
    """
    for k in range(min(len(text), len(marker) - 1), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


def skip_ws(text: str, pos: int) -> int:
    """The first position at or after `pos` that is not whitespace (str.isspace)."""
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


def text_until_marker(text: str, pos: int, markers: Sequence[str], final: bool) -> Step | None:
    """Plain text from `pos` up to the next marker, or up to what could still become one.

    Precondition: no marker starts at `pos` (the caller handles that case itself).
    """
    hits = [i for i in (text.find(m, pos) for m in markers) if i >= 0]
    if hits:
        end = min(hits)
    elif final:
        end = len(text)
    else:
        tail = text[pos:]
        end = len(text) - max(held_back_len(tail, m) for m in markers)
    return ([text[pos:end]], end) if end > pos else None
