"""Shared pieces of the system prompts that teach a model a tool-call format.

Used for chat templates that do not render `tools` themselves: the tools are listed as JSON (as
the Hermes, Qwen and Llama templates do) and each parser adds its exact output format.
"""

from __future__ import annotations

import json


def tool_function(tool: dict) -> dict:
    """The function spec of an OpenAI tool (`{"type": "function", "function": {...}}`) or a
    bare spec as given."""
    function = tool.get("function")
    return function if isinstance(function, dict) else tool


def tools_as_json_lines(tools: list[dict]) -> str:
    """One JSON function spec per line (name, description, parameters schema)."""
    return "\n".join(json.dumps(tool_function(t), ensure_ascii=False) for t in tools)
