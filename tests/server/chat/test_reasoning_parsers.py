"""Reasoning parsers: `<think>` splitting per format, and streaming that agrees with it.

Streaming is checked for every sample under random splits and for random texts built from tag
fragments: the concatenated reasoning and content deltas equal `extract` of the whole text.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from octavo.server.chat.reasoning import REASONING_PARSERS, ReasoningParser, get_reasoning_parser

Case = tuple[str, str | None, str | None]  # text, reasoning, content

COMMON: list[Case] = [
    ("<think>\nThe user wants 2+2.\n</think>\n\nIt is 4.", "The user wants 2+2.", "It is 4."),
    ("  <think>Hmm.</think>Answer\n", "Hmm.", "Answer\n"),
    ("<think>\n\n</think>\n\nJust the answer.", None, "Just the answer."),
    ("<think>Step 1: 日本語 🌍</think>Résumé: ✓", "Step 1: 日本語 🌍", "Résumé: ✓"),
    ("<think>a</think>b</think>c", "a", "b</think>c"),
    ("<think>I am still thinking and got cut o", "I am still thinking and got cut o", None),
    ("<think>done</think>   ", "done", None),
    ("", None, None),
    ("<think>", None, None),
]
R1: list[Case] = COMMON + [
    ("The user wants 2+2.\n</think>\n\nIt is 4.", "The user wants 2+2.", "It is 4."),
    ("No closing tag at all", "No closing tag at all", None),
    ("Okay <think> inside</think>out", "Okay <think> inside", "out"),
    ("</think>Only content", None, "Only content"),
]
QWEN3: list[Case] = COMMON + [
    ("The user wants 2+2.\n</think>\n\nIt is 4.", None,
     "The user wants 2+2.\n</think>\n\nIt is 4."),
    ("No thinking here.", None, "No thinking here."),
    ("\n\nNo thinking, leading newlines.", None, "No thinking, leading newlines."),
    ("<thinking>not a tag</thinking>", None, "<thinking>not a tag</thinking>"),
]
SAMPLES: dict[str, list[Case]] = {"deepseek_r1": R1, "qwen3": QWEN3}
ALL_SAMPLES = [(name, text) for name, cases in SAMPLES.items() for text, _, _ in cases]
FRAGMENTS = ["<think>", "</think>", "<thi", "nk>", "</th", "ink>", " ", "\n", "a", "b c", "<",
             "/", "é"]


def _pieces(text: str, cuts: list[int]) -> list[str]:
    points = sorted({c % (len(text) + 1) for c in cuts})
    bounds = [0, *points, len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


def check_stream(parser: ReasoningParser, text: str, pieces: list[str]) -> None:
    assert "".join(pieces) == text
    reasoning, content = parser.extract(text)
    stream = parser.stream()
    deltas = [stream.feed(p) for p in pieces] + [stream.finish()]
    assert all(r != "" and c != "" for r, c in deltas)
    assert "".join(r or "" for r, _ in deltas) == (reasoning or "")
    assert "".join(c or "" for _, c in deltas) == (content or "")


@pytest.mark.parametrize(("name", "text", "reasoning", "content"),
                         [(n, *case) for n, cases in SAMPLES.items() for case in cases])
def test_extract(name: str, text: str, reasoning: str | None, content: str | None):
    assert get_reasoning_parser(name).extract(text) == (reasoning, content)


@pytest.mark.parametrize(("name", "text"), ALL_SAMPLES)
def test_stream_whole_and_char_by_char(name: str, text: str):
    parser = get_reasoning_parser(name)
    check_stream(parser, text, [text])
    check_stream(parser, text, list(text))


@settings(max_examples=100, deadline=None)
@given(sample=st.sampled_from(ALL_SAMPLES), cuts=st.lists(st.integers(0, 10_000), max_size=12))
def test_stream_random_splits(sample: tuple[str, str], cuts: list[int]):
    name, text = sample
    check_stream(get_reasoning_parser(name), text, _pieces(text, cuts))


@settings(max_examples=150, deadline=None)
@given(name=st.sampled_from(sorted(SAMPLES)), parts=st.lists(st.sampled_from(FRAGMENTS),
                                                               max_size=16),
       cuts=st.lists(st.integers(0, 10_000), max_size=10))
def test_stream_random_texts(name: str, parts: list[str], cuts: list[int]):
    text = "".join(parts)
    parser = get_reasoning_parser(name)
    check_stream(parser, text, _pieces(text, cuts))
    check_stream(parser, text, list(text))


def test_stream_holds_back_partial_tags_only():
    stream = get_reasoning_parser("deepseek_r1").stream()
    assert stream.feed("<thi") == (None, None)
    assert stream.feed("nk>Let me see") == ("Let me see", None)
    assert stream.feed(" more</thi") == (" more", None)
    assert stream.feed("nk>\n\nThe answer") == (None, "The answer")
    assert stream.feed(" is 4.") == (None, " is 4.")
    assert stream.finish() == (None, None)


def test_qwen3_streams_plain_content_at_once():
    stream = get_reasoning_parser("qwen3").stream()
    assert stream.feed("Hello") == (None, "Hello")
    assert stream.feed(" </think> world") == (None, " </think> world")


def test_finish_flushes_a_partial_end_tag_as_reasoning():
    stream = get_reasoning_parser("qwen3").stream()
    assert stream.feed("<think>cut at </th") == ("cut at", None)
    assert stream.finish() == (" </th", None)


def test_registry_and_unknown_name():
    assert sorted(REASONING_PARSERS) == ["deepseek_r1", "qwen3"]
    assert all(get_reasoning_parser(n).name == n for n in REASONING_PARSERS)
    with pytest.raises(ValueError, match="unknown reasoning parser") as info:
        get_reasoning_parser("nope")
    assert all(n in str(info.value) for n in REASONING_PARSERS)
