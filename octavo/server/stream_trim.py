"""Trimming whitespace from streamed text so that the pieces add up to the trimmed whole.

Reasoning parsers strip reasoning on both ends and content on the left; tool-call parsers
strip content on both ends. Streamed, the leading whitespace is dropped until text comes, and
trailing whitespace is held until more text follows it (and dropped if nothing does).
"""

from __future__ import annotations


class LeadingTrimmer:
    """Streams text so that the concatenation of its output is `"".join(inputs).lstrip()`."""

    def __init__(self) -> None:
        self._started = False

    def push(self, text: str) -> str:
        if not self._started:
            text = text.lstrip()
            self._started = bool(text)
        return text


class StripTrimmer:
    """Streams text so that the concatenation of its output is `"".join(inputs).strip()`:
    trailing whitespace is held until more text follows it."""

    def __init__(self) -> None:
        self._lead = LeadingTrimmer()
        self._pending = ""

    def push(self, text: str) -> str:
        text = self._lead.push(text)
        body = text.rstrip()
        if not body:
            self._pending += text
            return ""
        out = self._pending + body
        self._pending = text[len(body):]
        return out
