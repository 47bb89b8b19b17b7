"""Reasoning parsers for the OpenAI-compatible server (vLLM's `--reasoning-parser`).

They split a thinking model's output into `reasoning_content` and `content`; see base.py for
the shared whitespace rules and think.py for the formats. Pure Python: no torch, no tokenizer.
"""

from __future__ import annotations

from octavo.server.chat.reasoning.base import ReasoningParser, ReasoningStream
from octavo.server.chat.reasoning.think import DeepSeekR1ReasoningParser, Qwen3ReasoningParser

REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    cls.name: cls for cls in (DeepSeekR1ReasoningParser, Qwen3ReasoningParser)
}


def get_reasoning_parser(name: str) -> ReasoningParser:
    """A new parser for `--reasoning-parser NAME`; ValueError naming the known ones otherwise."""
    cls = REASONING_PARSERS.get(name)
    if cls is None:
        known = ", ".join(sorted(REASONING_PARSERS))
        raise ValueError(f"unknown reasoning parser {name!r}; known parsers: {known}")
    return cls()


__all__ = ["REASONING_PARSERS", "ReasoningParser", "ReasoningStream", "get_reasoning_parser"]
