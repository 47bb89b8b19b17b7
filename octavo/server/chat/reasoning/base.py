"""The reasoning-parser interface (vLLM's `--reasoning-parser`) and its whitespace rules.

A reasoning parser splits generated text into `reasoning_content` (the model's thinking) and
`content` (the answer), whole (`extract`) or streamed (`stream`, one per choice). Both apply the
same rules, so the concatenated stream deltas equal `extract` of the whole text: reasoning is
stripped of surrounding whitespace, content of leading whitespace only (the newlines after
`</think>`; what the answer ends with is kept), and either is None when nothing is left.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

Pair = tuple[str | None, str | None]  # (reasoning, content)


def strip_reasoning(text: str) -> str | None:
    return text.strip() or None


def strip_content(text: str) -> str | None:
    return text.lstrip() or None


class ReasoningStream(ABC):
    """Per-choice streaming state: (reasoning delta, content delta) per fed delta."""

    @abstractmethod
    def feed(self, delta_text: str) -> Pair: ...

    @abstractmethod
    def finish(self) -> Pair:
        """Flush text held back at the end of generation."""


class ReasoningParser(ABC):
    """One reasoning format: whole-output extraction and per-choice streaming."""

    name: ClassVar[str]

    @abstractmethod
    def extract(self, text: str) -> Pair:
        """(reasoning_content, content) of a whole output, None when empty."""

    @abstractmethod
    def stream(self) -> ReasoningStream:
        """A fresh streaming state for one choice."""
