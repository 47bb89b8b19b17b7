"""`<think>...</think>` reasoning: DeepSeek-R1 and Qwen3 (vLLM's "deepseek_r1" and "qwen3").

Reasoning is the text before `</think>` (a leading `<think>` is not part of it), content what
follows. The two differ only when `</think>` never comes:
- deepseek_r1: R1's chat template opens `<think>` in the prompt, so the output may start
  without it; the output is reasoning up to `</think>`, and all of it without one (cut short).
- qwen3: thinking counts only when the output starts (after whitespace) with `<think>`; then
  an output without `</think>` is all reasoning (cut short), and one that does not start with
  `<think>` is all content, `</think>` or not. (Templates that open `<think>` in the prompt,
  such as the Qwen3 *-Thinking-2507 models, need deepseek_r1.)
Streaming holds back a partial `<think>` at the start and a partial `</think>` at the end.
"""

from __future__ import annotations

from typing import ClassVar

from octavo.server.chat.reasoning.base import (
    Pair,
    ReasoningParser,
    ReasoningStream,
    strip_content,
    strip_reasoning,
)
from octavo.server.stream_trim import LeadingTrimmer, StripTrimmer

START = "<think>"
END = "</think>"


def _held_back_len(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for k in range(min(len(text), len(marker) - 1), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


class _ThinkStream(ReasoningStream):
    def __init__(self, requires_start_tag: bool) -> None:
        self._requires_start_tag = requires_start_tag
        self._text = ""
        self._pos = 0
        self._mode = "start"  # start -> reasoning | content; reasoning -> content
        self._reasoning = StripTrimmer()
        self._content = LeadingTrimmer()
        self._finished = False

    def feed(self, delta_text: str) -> Pair:
        if self._finished:
            raise RuntimeError("feed() after finish()")
        self._text += delta_text
        return self._advance(final=False)

    def finish(self) -> Pair:
        if self._finished:
            return None, None
        pair = self._advance(final=True)
        self._finished = True
        return pair

    def _advance(self, final: bool) -> Pair:
        reasoning: list[str] = []
        content: list[str] = []
        text = self._text
        if self._mode == "start":
            rest = text.lstrip()
            if rest.startswith(START):
                self._pos = len(text) - len(rest) + len(START)
                self._mode = "reasoning"
            elif not final and START.startswith(rest):
                return None, None
            else:
                self._mode = "content" if self._requires_start_tag else "reasoning"
        if self._mode == "reasoning":
            end = text.find(END, self._pos)
            if end >= 0:
                reasoning.append(self._reasoning.push(text[self._pos:end]))
                self._pos = end + len(END)
                self._mode = "content"
            else:
                stop = len(text) if final else len(text) - _held_back_len(text[self._pos:], END)
                reasoning.append(self._reasoning.push(text[self._pos:stop]))
                self._pos = stop
        if self._mode == "content":
            content.append(self._content.push(text[self._pos:]))
            self._pos = len(text)
        return "".join(reasoning) or None, "".join(content) or None


class ThinkReasoningParser(ReasoningParser):
    """Shared `<think>` logic; subclasses say whether the output must open `<think>` itself."""

    requires_start_tag: ClassVar[bool]

    def extract(self, text: str) -> Pair:
        rest = text.lstrip()
        opened = rest.startswith(START)
        if self.requires_start_tag and not opened:
            return None, strip_content(text)
        body = rest[len(START):] if opened else text
        end = body.find(END)
        if end < 0:
            return strip_reasoning(body), None
        return strip_reasoning(body[:end]), strip_content(body[end + len(END):])

    def stream(self) -> ReasoningStream:
        return _ThinkStream(self.requires_start_tag)


class DeepSeekR1ReasoningParser(ThinkReasoningParser):
    """DeepSeek-R1 and its distills: reasoning up to `</think>`, all reasoning without one."""

    name = "deepseek_r1"
    requires_start_tag = False


class Qwen3ReasoningParser(ThinkReasoningParser):
    """Qwen3: `<think>...</think>` at the start of the output; otherwise all content."""

    name = "qwen3"
    requires_start_tag = True
