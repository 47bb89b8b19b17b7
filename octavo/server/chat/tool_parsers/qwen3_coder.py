"""Qwen3-Coder's XML tool calls (vLLM's "qwen3_coder" parser):

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

Every argument is written as text: one leading and one trailing newline are dropped, and the
value is typed by the tool's schema, as vLLM reads it: `null` is null for any type; integer,
number and boolean parameters are parsed as such; objects and arrays as JSON (or Python
literals); a string, or a parameter the schema does not list, stays text; a value that does
not parse as its type stays text too. A value ends at `</parameter>`, or where the next
`<parameter=` or `</function>` begins.

Text before, between and after blocks is content. A block that is not well formed (no
function name, text between parameters, a parameter given twice, no `</function>`) stays in
the content verbatim from its `<tool_call>` on, and scanning resumes after that tag. The last
block may lack `</tool_call>` (generation stopped on it). Streaming announces a call at its
`<function=NAME>`, sends each parameter as it completes, and the text of string parameters as
it is generated.
"""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass, field
from typing import Any

from octavo.server.chat.tool_parsers.base import ToolParser
from octavo.server.chat.tool_parsers.calls import dump_arguments
from octavo.server.chat.tool_parsers.json_stream import dumps, escape_char
from octavo.server.chat.tool_parsers.prompting import tool_function, tools_as_json_lines
from octavo.server.chat.tool_parsers.scanning import (
    ParsedCall,
    PartialCall,
    Scanner,
    Step,
    held_back_len,
    skip_ws,
    text_until_marker,
)

START, END = "<tool_call>", "</tool_call>"
FUNCTION, FUNCTION_END = "<function=", "</function>"
PARAMETER, PARAMETER_END = "<parameter=", "</parameter>"
VALUE_ENDS = (PARAMETER_END, PARAMETER, FUNCTION_END)
_NAME = re.compile(r"[A-Za-z0-9_.\-]+")
_PARAM_NAME = re.compile(r"[^<>\n]+")
_INTEGER = re.compile(r"\s*[-+]?\d+\s*")
_STRING_TYPES = ("string", "str", "text", "varchar", "char", "enum")
_PARSE_ERRORS = (ValueError, TypeError, SyntaxError, MemoryError, RecursionError)


def _schema_type(schema: Any) -> str:
    """The declared type of a parameter, lower-cased ("string" when it declares none)."""
    t = schema.get("type") if isinstance(schema, dict) else None
    if isinstance(t, list):  # ["integer", "null"]: the first type that is not null
        t = next((x for x in t if x != "null"), "string")
    return str(t if t is not None else "string").strip().lower()


def convert(value: str, schema: Any | None) -> Any:
    """A parameter's text as the value its schema types it as (`None`: not in the schema)."""
    if value.lower() == "null":
        return None
    if schema is None:
        return value
    t = _schema_type(schema)
    if t in _STRING_TYPES:
        return value
    if t.startswith(("int", "uint", "long", "short", "unsigned")):
        return int(value) if _INTEGER.fullmatch(value) else value
    if t.startswith(("num", "float")):
        try:
            number = float(value)
        except ValueError:
            return value
        if number != number or number in (float("inf"), float("-inf")):
            return value
        return int(number) if number.is_integer() else number
    if t in ("boolean", "bool", "binary"):
        return value.strip().lower() == "true"
    try:
        parsed = json.loads(value)
    except _PARSE_ERRORS:
        try:
            parsed = ast.literal_eval(value)
        except _PARSE_ERRORS:
            return value
    return parsed if dump_arguments({"v": parsed}) is not None else value


def _strip_newlines(value: str) -> str:
    if value.startswith("\n"):
        value = value[1:]
    return value[:-1] if value.endswith("\n") else value


@dataclass
class _Block:
    """A `<tool_call>` block read as far as the text goes."""

    state: str  # "call", "malformed" or "open"
    end: int = 0
    name: str | None = None
    params: list[tuple[str, str]] = field(default_factory=list)
    open_param: tuple[str, int] | None = None  # a parameter whose value has not ended
    closed: bool = False  # </function> seen


def _read_block(text: str, pos: int, final: bool) -> _Block:
    """The block whose `<tool_call>` is at `pos`."""
    malformed, wait = _Block("malformed"), _Block("open")
    p = skip_ws(text, pos + len(START))
    if not text.startswith(FUNCTION, p):
        return wait if not final and FUNCTION.startswith(text[p:]) else malformed
    q = p + len(FUNCTION)
    gt = text.find(">", q)
    if gt < 0:
        return wait if not final and (q == len(text) or _NAME.fullmatch(text[q:])) \
            else malformed
    block = _Block("open", name=text[q:gt])
    if not _NAME.fullmatch(block.name or ""):
        return malformed
    p = gt + 1
    while True:
        p = skip_ws(text, p)
        if text.startswith(PARAMETER, p):
            r = p + len(PARAMETER)
            gt = text.find(">", r)
            if gt < 0:
                ok = not final and (r == len(text) or _PARAM_NAME.fullmatch(text[r:]))
                return block if ok else malformed
            name = text[r:gt]
            if not _PARAM_NAME.fullmatch(name) or any(name == n for n, _ in block.params):
                return malformed
            hits = [(i, t) for i, t in ((text.find(t, gt + 1), t) for t in VALUE_ENDS) if i >= 0]
            if not hits:
                if final:
                    return malformed
                block.open_param = (name, gt + 1)
                return block
            i, t = min(hits)
            block.params.append((name, _strip_newlines(text[gt + 1:i])))
            p = i + len(PARAMETER_END) if t == PARAMETER_END else i
        elif text.startswith(FUNCTION_END, p):
            block.closed = True
            r = skip_ws(text, p + len(FUNCTION_END))
            if text.startswith(END, r):
                block.state, block.end = "call", r + len(END)
            elif r == len(text) and final:  # stopped on </tool_call>
                block.state, block.end = "call", r
            elif final or not END.startswith(text[r:]):
                return malformed
            return block
        else:
            rest = text[p:]
            if final or not (PARAMETER.startswith(rest) or FUNCTION_END.startswith(rest)):
                return malformed
            return block


class _Qwen3CoderScanner(Scanner):
    def __init__(self, schemas: dict[str, dict[str, Any]]) -> None:
        self._schemas = schemas  # function name -> its parameters' schemas

    def _arguments(self, block: _Block) -> dict[str, Any]:
        schema = self._schemas.get(block.name or "", {})
        return {n: convert(v, schema.get(n)) for n, v in block.params}

    def step(self, text: str, pos: int, final: bool) -> Step | None:
        if not text.startswith(START, pos):
            return text_until_marker(text, pos, (START,), final)
        block = _read_block(text, pos, final)
        if block.state == "open":
            return None
        arguments = dump_arguments(self._arguments(block)) if block.state == "call" else None
        if arguments is None or block.name is None:
            return [START], pos + len(START)
        return [ParsedCall(block.name, arguments)], block.end

    def partial(self, text: str, pos: int) -> list[PartialCall]:
        if not text.startswith(START, pos):
            return []  # the text waits on what may become a tag
        block = _read_block(text, pos, False)
        if block.state != "open" or block.name is None:
            return []
        pieces = [f"{dumps(n)}: {dumps(v)}" for n, v in self._arguments(block).items()]
        arguments = "{" + ", ".join(pieces)
        if block.closed:
            return [PartialCall(block.name, arguments + "}")]
        if block.open_param is not None:
            name, start = block.open_param
            schema = self._schemas.get(block.name, {}).get(name)
            if schema is None or _schema_type(schema) in _STRING_TYPES:
                shown = _visible(text[start:])
                if shown and not "null".startswith(shown.lower()):
                    arguments += (", " if pieces else "") + f'{dumps(name)}: "' + "".join(
                        escape_char(c) for c in shown)
        return [PartialCall(block.name, arguments)]


def _visible(raw: str) -> str:
    """What of a string parameter's text so far is certainly part of its value: not the
    leading newline, nor what may still become the end of the value and its newline."""
    if raw.startswith("\n"):
        raw = raw[1:]
    raw = raw[:len(raw) - max(held_back_len(raw, t) for t in VALUE_ENDS)]
    return raw[:-1] if raw.endswith("\n") else raw


class Qwen3CoderToolParser(ToolParser):
    """vLLM's "qwen3_coder" parser (Qwen3-Coder, and Qwen3.5 models that use its format)."""

    name = "qwen3_coder"

    def scanner(self) -> Scanner:
        schemas: dict[str, dict[str, Any]] = {}
        for tool in self.tools:
            function = tool_function(tool)
            parameters = function.get("parameters") or {}
            properties = parameters.get("properties") if isinstance(parameters, dict) else None
            schemas[str(function.get("name"))] = properties if isinstance(properties, dict) \
                else {}
        return _Qwen3CoderScanner(schemas)

    def system_prompt(self, tools: list[dict]) -> str:
        return (
            "# Tools\n\n"
            "You have access to the following functions, described as JSON:\n\n"
            f"<tools>\n{tools_as_json_lines(tools)}\n</tools>\n\n"
            "If you choose to call a function ONLY reply in the following format with NO "
            "suffix:\n\n"
            "<tool_call>\n"
            "<function=example_function_name>\n"
            "<parameter=example_parameter_1>\n"
            "value_1\n"
            "</parameter>\n"
            "<parameter=example_parameter_2>\n"
            "This is the value for the second parameter\n"
            "that can span\n"
            "multiple lines\n"
            "</parameter>\n"
            "</function>\n"
            "</tool_call>\n\n"
            "Function calls MUST follow this format: an inner <function=...></function> block "
            "nested within <tool_call></tool_call> tags, with every required parameter. You "
            "may explain your call BEFORE it, but not after. If no function fits, answer "
            "normally."
        )
