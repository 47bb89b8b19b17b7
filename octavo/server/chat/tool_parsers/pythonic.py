"""Pythonic tool calls (Llama 3.2 / Llama 4): `[get_weather(city="Paris"), other(x=1)]`.

The whole output, whitespace aside and optionally wrapped in Llama 4's `<|python_start|>` ...
`<|python_end|>`, must be one Python list of calls with keyword arguments whose values are
literals (str, int, float, bool, None, lists, dicts; read with `ast.literal_eval`, never run).
Anything else is all content. Streaming passes content through as soon as the text can no
longer be such a list (it does not begin like `[name(`, the list holds something else, or text
follows it); otherwise it waits, since a list of calls is known only at the end.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator

from octavo.server.chat.tool_parsers.base import ToolParser
from octavo.server.chat.tool_parsers.calls import dump_arguments
from octavo.server.chat.tool_parsers.prompting import tools_as_json_lines
from octavo.server.chat.tool_parsers.scanning import ParsedCall, Scanner, Step, skip_ws

START_TAG = "<|python_start|>"
END_TAG = "<|python_end|>"
_NAME = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*")
_PARSE_ERRORS = (SyntaxError, ValueError, TypeError, RecursionError, MemoryError)
_STRING = re.compile(r"'(?:\\.|[^'\\\n])*'" r'|"(?:\\.|[^"\\\n])*"')


def _list_start(text: str) -> int | None:
    """Where the `[` of a list beginning like `[name(` is; -1 if the text cannot begin like one
    whatever follows it; None if that is not known yet."""
    i = skip_ws(text, 0)
    if i < len(text) and text.startswith(START_TAG, i):
        i = skip_ws(text, i + len(START_TAG))
    elif START_TAG.startswith(text[i:]):
        return None  # empty, or a beginning of the start tag
    if i == len(text):
        return None
    if text[i] != "[":
        return -1
    j = skip_ws(text, i + 1)
    if j == len(text):
        return None
    match = _NAME.match(text, j)
    if match is None:
        return -1
    k = match.end()
    if k == len(text) or (text[k] == "." and k + 1 == len(text)):
        return None
    return i if text[k] == "(" else -1


class _Brackets:
    """Bracket depth of the source read so far, skipping one-line string literals.

    Finds where the list can close (depth back to 0 at a `]`) in one pass over a growing text,
    so `ast.parse` runs only there. It reads the same on any split: a string it cannot close
    yet (no newline after its quote) is waited for, and taken as a plain quote at the end.
    """

    def __init__(self, start: int) -> None:
        self.pos = start
        self.depth = 0
        self._seen = -1  # text length when a string at `pos` was last found open (a cache)

    def closers(self, text: str, final: bool) -> Iterator[int]:
        while self.pos < len(text):
            ch = text[self.pos]
            if ch in "'\"":
                if not final and self._seen >= 0 and text.find(ch, self._seen) < 0 \
                        and text.find("\n", self._seen) < 0:
                    self._seen = len(text)  # still open: nothing that could close it arrived
                    return
                match = _STRING.match(text, self.pos)
                if match:
                    self.pos, self._seen = match.end(), -1
                    continue
                if not final and text.find("\n", self.pos) < 0:
                    self._seen = len(text)
                    return
                self._seen = -1
            elif ch in "([{":
                self.depth += 1
            elif ch in ")]}":
                self.depth -= 1
                if self.depth == 0 and ch == "]":
                    self.pos += 1
                    yield self.pos - 1
                    continue
            self.pos += 1


def _function_name(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        owner = _function_name(node.value)
        return None if owner is None else f"{owner}.{node.attr}"
    return None


def _calls_from_list(node: ast.List) -> list[ParsedCall] | None:
    calls: list[ParsedCall] = []
    for element in node.elts:
        if not isinstance(element, ast.Call) or element.args:
            return None
        name = _function_name(element.func)
        if name is None or any(kw.arg is None for kw in element.keywords):
            return None
        try:
            arguments = {kw.arg: ast.literal_eval(kw.value) for kw in element.keywords}
        except _PARSE_ERRORS:
            return None
        dumped = dump_arguments(arguments)
        if dumped is None:
            return None
        calls.append(ParsedCall(name, dumped))
    return calls or None


def _only_end_tag(rest: str, final: bool) -> bool | None:
    """Whether what follows the list is whitespace and at most an end tag (None: not known)."""
    rest = rest.strip() if final else rest.lstrip()
    if rest.startswith(END_TAG):
        blank = not rest[len(END_TAG):].strip()
        return blank if final else (None if blank else False)
    if final:
        return not rest
    return None if END_TAG.startswith(rest) else False


class _PythonicScanner(Scanner):
    def __init__(self) -> None:
        self._content = False  # decided: the output is plain content
        self._brackets: _Brackets | None = None
        self._list: tuple[int, ast.expr] | None = None  # where the list closes, its node

    def step(self, text: str, pos: int, final: bool) -> Step | None:
        if self._content:
            return [text[pos:]], len(text)
        verdict = self._judge(text, final)
        if verdict is None:
            return None
        if verdict is False:
            self._content = True
            return [text[pos:]], len(text)
        return list(verdict), len(text)

    def _judge(self, text: str, final: bool) -> list[ParsedCall] | bool | None:
        """The calls (only when `final`), False when it is content, None when not known."""
        if self._list is None:
            start = _list_start(text)
            if start is None:
                return False if final else None
            if start < 0:
                return False
            self._brackets = self._brackets or _Brackets(start)
            for close in self._brackets.closers(text, final):
                try:
                    self._list = close, ast.parse(text[start:close + 1], mode="eval").body
                    break
                except _PARSE_ERRORS:
                    continue
            if self._list is None:
                return False if final else None
        close, node = self._list
        calls = _calls_from_list(node) if isinstance(node, ast.List) else None
        if calls is None:
            return False
        only_end = _only_end_tag(text[close + 1:], final)
        if only_end is None:
            return None
        return calls if only_end else False


class PythonicToolParser(ToolParser):
    """vLLM's "pythonic" parser (Llama 3.2 and Llama 4 pythonic tool calling)."""

    name = "pythonic"

    def scanner(self) -> Scanner:
        return _PythonicScanner()

    def system_prompt(self, tools: list[dict]) -> str:
        return (
            "You are an expert in composing functions. You are given a question and a set of "
            "possible functions. Based on the question, you may need to make one or more "
            "function calls to achieve the purpose.\n"
            "If you decide to invoke any of the function(s), you MUST put it in the format of "
            "[func_name1(param_name1=value1, param_name2=value2), func_name2(param=value)] "
            "using Python literal values, and you SHOULD NOT include any other text in the "
            "response. If no function is needed, answer normally.\n\n"
            "Here is a list of functions in JSON format that you can invoke:\n"
            f"{tools_as_json_lines(tools)}"
        )
