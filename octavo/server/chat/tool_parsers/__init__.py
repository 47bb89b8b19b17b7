"""Tool-call parsers for the OpenAI-compatible server (vLLM's `--tool-call-parser`).

Each parser reads one model family's tool-call format out of generated text, whole or streamed;
see base.py for the shared semantics. Pure Python: no torch, no tokenizer.
"""

from __future__ import annotations

from octavo.server.chat.tool_parsers.base import (
    DeltaResult,
    ExtractedToolCalls,
    ToolCall,
    ToolCallDelta,
    ToolCallStream,
    ToolParser,
)
from octavo.server.chat.tool_parsers.hermes import HermesToolParser
from octavo.server.chat.tool_parsers.llama3_json import Llama3JsonToolParser
from octavo.server.chat.tool_parsers.mistral import MistralToolParser
from octavo.server.chat.tool_parsers.pythonic import PythonicToolParser
from octavo.server.chat.tool_parsers.qwen3_coder import Qwen3CoderToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    cls.name: cls
    for cls in (HermesToolParser, Llama3JsonToolParser, MistralToolParser, PythonicToolParser,
                Qwen3CoderToolParser)
}


def get_tool_parser(name: str, tools: list[dict] | None = None) -> ToolParser:
    """A new parser for `--tool-call-parser NAME` and a request's `tools` (OpenAI tool dicts);
    ValueError naming the known ones otherwise."""
    cls = TOOL_PARSERS.get(name)
    if cls is None:
        known = ", ".join(sorted(TOOL_PARSERS))
        raise ValueError(f"unknown tool-call parser {name!r}; known parsers: {known}")
    return cls(tools)


__all__ = [
    "TOOL_PARSERS",
    "DeltaResult",
    "ExtractedToolCalls",
    "ToolCall",
    "ToolCallDelta",
    "ToolCallStream",
    "ToolParser",
    "get_tool_parser",
]
