"""Hermes / Qwen tool calls: `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`.

Several blocks may follow each other; text before, between and after them is content. A block
whose body is not one JSON call object stays in the content verbatim (its `<tool_call>` tag
included) and scanning resumes right after that tag, so a well-formed block after it still
counts. The last block may lack `</tool_call>` (generation stopped on it): it is a call if the
rest of the output is exactly one call object.
"""

from __future__ import annotations

from octavo.server.chat.tool_parsers.base import ToolParser
from octavo.server.chat.tool_parsers.calls import call_from_object, decode_json
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

START = "<tool_call>"
END = "</tool_call>"


def _parse_body(body: str) -> ParsedCall | None:
    ok, obj = decode_json(body)
    return call_from_object(obj) if ok else None


class _HermesScanner(Scanner):
    def __init__(self) -> None:
        self._open = (-1, 0)  # cache: (body start of an open block, text length searched)
        self._calls = CallStreams()

    def partial(self, text: str, pos: int) -> list[PartialCall]:
        if not text.startswith(START, pos):
            return []  # the text waits on what may become a tag
        p = skip_ws(text, pos + len(START))
        if p == len(text) or text[p] != "{":
            return []
        return partial_calls(self._calls.at(text, p, 0))

    def step(self, text: str, pos: int, final: bool) -> Step | None:
        if not text.startswith(START, pos):
            return text_until_marker(text, pos, (START,), final)
        body_start = pos + len(START)
        opened, searched = self._open
        since = max(body_start, searched - len(END) + 1) if opened == body_start else body_start
        end = text.find(END, since)
        if end < 0:
            if not final:
                self._open = (body_start, len(text))
                return None
            call = _parse_body(text[body_start:])
            return ([call], len(text)) if call else ([START], body_start)
        call = _parse_body(text[body_start:end])
        return ([call], end + len(END)) if call else ([START], body_start)


class HermesToolParser(ToolParser):
    """vLLM's "hermes" parser (Hermes 2/3, Qwen 2.5/3 and other ChatML tool models)."""

    name = "hermes"

    def scanner(self) -> Scanner:
        return _HermesScanner()

    def system_prompt(self, tools: list[dict]) -> str:
        return (
            "# Tools\n\n"
            "You may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n"
            f"<tools>\n{tools_as_json_lines(tools)}\n</tools>\n\n"
            "For each function call, return a json object with function name and arguments "
            "within <tool_call></tool_call> XML tags:\n"
            "<tool_call>\n"
            '{"name": <function-name>, "arguments": <args-json-object>}\n'
            "</tool_call>"
        )
