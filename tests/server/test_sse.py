"""Server-Sent Events stay one line per event for every line splitter: generated text may hold
characters JSON leaves raw but str.splitlines() (httpx's aiter_lines) breaks on."""

from __future__ import annotations

import json

from octavo.server.serving_common import sse


def test_an_event_is_one_line_whatever_the_text():
    text = "a\x85b\u2028c\u2029d\x1ce\x0bf\r\ng"
    for payload in (json.dumps({"text": text}), json.dumps({"text": text}, ensure_ascii=False)):
        event = sse(payload)
        lines = event.splitlines()
        assert lines == [lines[0], ""] and lines[0].startswith("data: ")
        assert json.loads(lines[0][6:]) == {"text": text}
