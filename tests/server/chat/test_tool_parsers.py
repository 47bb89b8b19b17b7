"""Tool-call parsers: whole-output extraction per format, and streaming that agrees with it.

The streaming property is checked for every sample under random splits into deltas, and for
random texts built from each format's marker fragments (where stream/extract disagreements
would hide): concatenated content deltas equal the extracted content, each call's first delta
carries its id and name, and its argument fragments join to exactly the extracted arguments.
"""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from octavo.server.chat.tool_parsers import TOOL_PARSERS, ToolCallDelta, ToolParser, get_tool_parser

Expected = tuple[str, list[tuple[str, dict]], str | None]  # text, calls, content

WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
TIME = '{"name": "get_time", "arguments": {"timezone": "Europe/Paris"}}'
UNICODE_ARGS = {"city": "Zürich", "note": "日本語 🌍 \"quoted\""}
NESTED_ARGS = {"filter": {"range": [1, 2.5], "tags": ["a", {"b": None}], "on": True}}
W = ("get_weather", {"city": "Paris", "unit": "celsius"})
T = ("get_time", {"timezone": "Europe/Paris"})

HERMES: list[Expected] = [
    (f"<tool_call>\n{WEATHER}\n</tool_call>", [W], None),
    (f"<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n{TIME}\n</tool_call>", [W, T], None),
    (f"Let me check the weather.\n<tool_call>\n{WEATHER}\n</tool_call>", [W],
     "Let me check the weather."),
    ("The capital of France is Paris.", [], "The capital of France is Paris."),
    ('<tool_call>\n{"name": "f", "arguments": {"a": 1}\n</tool_call>', [],
     '<tool_call>\n{"name": "f", "arguments": {"a": 1}\n</tool_call>'),
    ("<tool_call>\n" + json.dumps({"name": "geo", "arguments": UNICODE_ARGS}) + "\n</tool_call>",
     [("geo", UNICODE_ARGS)], None),
    ("<tool_call>" + json.dumps({"name": "q", "arguments": NESTED_ARGS}) + "</tool_call>",
     [("q", NESTED_ARGS)], None),
    (f"<tool_call>\n{WEATHER}", [W], None),  # stopped on </tool_call>
    ('<tool_call>\n{"name": "get_weather", "argu', [],
     '<tool_call>\n{"name": "get_weather", "argu'),
    (f"<tool_call>oops</tool_call>\n<tool_call>{TIME}</tool_call>", [T],
     "<tool_call>oops</tool_call>"),
    ('<tool_call>{"name": "f", "parameters": {"a": 1}}</tool_call>', [("f", {"a": 1})], None),
    ('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>', [("f", {"a": 1})], None),
    ('<tool_call>{"name": "now"}</tool_call>', [("now", {})], None),
    (f"<tool_call>{WEATHER}</tool_call>\nDone.", [W], "Done."),
    ("Use <tools> wisely, <tool_call", [], "Use <tools> wisely, <tool_call"),
    ('<tool_call>{"name": "f", "arguments": {"x": NaN}}</tool_call>', [],
     '<tool_call>{"name": "f", "arguments": {"x": NaN}}</tool_call>'),
]

L_WEATHER = '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}'
LLAMA3: list[Expected] = [
    (f"<|python_tag|>{L_WEATHER}", [W], None),
    (L_WEATHER, [W], None),
    (f"  \n{L_WEATHER}", [W], None),
    (f'{L_WEATHER}; {{"name": "get_time", "arguments": {{"timezone": "Europe/Paris"}}}}',
     [W, T], None),
    (f"Let me look that up.<|python_tag|>{L_WEATHER}", [W], "Let me look that up."),
    ("Paris is the capital of France.", [], "Paris is the capital of France."),
    ('{"answer": 42}', [], '{"answer": 42}'),
    ('{"name": "Alice", "age": 30}', [], '{"name": "Alice", "age": 30}'),
    ('{"name": "f", "parameters": {"a": 1}', [], '{"name": "f", "parameters": {"a": 1}'),
    (json.dumps({"name": "geo", "parameters": UNICODE_ARGS}, ensure_ascii=False),
     [("geo", UNICODE_ARGS)], None),
    ("<|python_tag|>" + json.dumps({"name": "q", "parameters": NESTED_ARGS}),
     [("q", NESTED_ARGS)], None),
    ('{"name": "f", "parameters": {}}\nHope this helps!', [("f", {})], "Hope this helps!"),
    ('Answer: {"name": "f", "parameters": {}}', [], 'Answer: {"name": "f", "parameters": {}}'),
    ('{"name": "f", "parameters": {}};', [("f", {})], None),
    ('{"name": "a", "parameters": {}}; {"name": "b", "par', [("a", {})],
     '; {"name": "b", "par'),
    ('{"type": "function", "name": "f", "parameters": {"x": 1}}', [("f", {"x": 1})], None),
    ("<|python_tag|>print('hi')", [], "<|python_tag|>print('hi')"),
]

M_LIST = f'[{WEATHER}, {TIME}]'
MISTRAL: list[Expected] = [
    (f"[TOOL_CALLS][{WEATHER}]", [W], None),
    (f"[TOOL_CALLS]{M_LIST}", [W, T], None),
    (f"[TOOL_CALLS] {M_LIST}", [W, T], None),
    (f"Sure, checking.\n[TOOL_CALLS][{WEATHER}]", [W], "Sure, checking."),
    ("Paris is lovely in spring.", [], "Paris is lovely in spring."),
    ('[TOOL_CALLS][{"name": "f", "arguments": {]', [],
     '[TOOL_CALLS][{"name": "f", "arguments": {]'),
    ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "celsius"}', [W], None),
    ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "celsius"}[TOOL_CALLS]get_time'
     '[ARGS]{"timezone": "Europe/Paris"}', [W, T], None),
    ("[TOOL_CALLS]geo[ARGS]" + json.dumps(UNICODE_ARGS), [("geo", UNICODE_ARGS)], None),
    ("[TOOL_CALLS]" + json.dumps([{"name": "q", "arguments": NESTED_ARGS}], ensure_ascii=False),
     [("q", NESTED_ARGS)], None),
    ("[TOOL_CALLS]not a name[ARGS]{}", [], "[TOOL_CALLS]not a name[ARGS]{}"),
    ('[TOOL_CALLS]f[ARGS]{"a": 1', [], '[TOOL_CALLS]f[ARGS]{"a": 1'),
    ("[TOOL_CALLS][1, 2]", [], "[TOOL_CALLS][1, 2]"),
    (f"[TOOL_CALLS][{WEATHER}] Anything else?", [W], "Anything else?"),
]

PYTHONIC: list[Expected] = [
    ('[get_weather(city="Paris", unit="celsius")]', [W], None),
    ('[get_weather(city="Paris", unit="celsius"), get_time(timezone="Europe/Paris")]', [W, T],
     None),
    (' \n[get_weather(city="Paris", unit="celsius")]\n', [W], None),
    ('<|python_start|>[get_time(timezone="Europe/Paris")]<|python_end|>', [T], None),
    ("Paris is nice in June.", [], "Paris is nice in June."),
    ("[1, 2, 3]", [], "[1, 2, 3]"),
    ("[link](https://example.com)", [], "[link](https://example.com)"),
    ('[get_weather(city="Paris"', [], '[get_weather(city="Paris"'),
    ("[f(1)]", [], "[f(1)]"),
    ("[f(x=open('a'))]", [], "[f(x=open('a'))]"),
    ('[geo(city="Zürich", note="日本語 🌍 \\"quoted\\"")]', [("geo", UNICODE_ARGS)], None),
    ('[q(filter={"range": [1, 2.5], "tags": ["a", {"b": None}], "on": True})]',
     [("q", NESTED_ARGS)], None),
    ("[f(x=1)] and more", [], "[f(x=1)] and more"),
    ("Calling: [f(x=1)]", [], "Calling: [f(x=1)]"),
    ('[brave_search.call(query="weather Paris")]',
     [("brave_search.call", {"query": "weather Paris"})], None),
    ('[f(s="a]b", n=-3)]', [("f", {"s": "a]b", "n": -3})], None),
    ("[get_time()]", [("get_time", {})], None),
    ("[f(x={1, 2})]", [], "[f(x={1, 2})]"),
]

SAMPLES: dict[str, list[Expected]] = {
    "hermes": HERMES, "llama3_json": LLAMA3, "mistral": MISTRAL, "pythonic": PYTHONIC,
}
ALL_SAMPLES = [(name, text) for name, cases in SAMPLES.items() for text, _, _ in cases]

# fragments of each format, joined at random to probe stream/extract agreement
FRAGMENTS: dict[str, list[str]] = {
    "hermes": ["<tool_call>", "</tool_call>", "<tool", "_call>", WEATHER, '{"name": "g"}', "{",
               "}", '"', "\n", " ", "x", "é", "<", "/"],
    "llama3_json": ["<|python_tag|>", "<|python", "_tag|>", L_WEATHER, '{"name": "g"}',
                    '{"x": 1}', ";", " ", "\n", "{", "}", "x", '"'],
    "mistral": ["[TOOL_CALLS]", "[TOOL_", "CALLS]", "[ARGS]", "[AR", "f", "g.h", '{"a": 1}',
                f"[{TIME}]", WEATHER, "[", "]", "{", "}", " ", "x y", "\n"],
    "pythonic": ["<|python_start|>", "<|python_end|>", "<|py", "[", "]", "f(", "g.h(", ")",
                 "x=1", 'y="a]"', ",", " ", "\n", "(", "z", "=", "None", "[1]"],
}


def _pieces(text: str, cuts: list[int]) -> list[str]:
    points = sorted({c % (len(text) + 1) for c in cuts})
    bounds = [0, *points, len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


def check_stream(parser: ToolParser, text: str, pieces: list[str]) -> None:
    """Streaming `pieces` (joining to `text`) agrees with extracting `text` at once."""
    assert "".join(pieces) == text
    expected = parser.extract_tool_calls(text)
    stream = parser.stream()
    results = [stream.feed(p) for p in pieces] + [stream.finish()]
    assert all(r.content != "" for r in results)
    assert "".join(r.content or "" for r in results) == (expected.content or "")
    deltas: dict[int, list[ToolCallDelta]] = {}
    for d in (d for r in results for d in r.tool_calls):
        assert d.index == len(deltas) or d.index in deltas  # indices appear in order
        deltas.setdefault(d.index, []).append(d)
    assert len(deltas) == len(expected.tool_calls)
    for index, call in enumerate(expected.tool_calls):
        first, *later = deltas[index]
        assert first.id and first.name == call.name
        assert all(d.id is None and d.name is None for d in later)
        arguments = "".join(d.arguments or "" for d in deltas[index])
        assert arguments == call.arguments
        assert isinstance(json.loads(arguments), dict)


@pytest.mark.parametrize(("name", "text", "calls", "content"),
                         [(n, *case) for n, cases in SAMPLES.items() for case in cases])
def test_extract(name: str, text: str, calls: list[tuple[str, dict]], content: str | None):
    result = get_tool_parser(name).extract_tool_calls(text)
    assert result.tools_called == bool(calls)
    assert [(c.name, json.loads(c.arguments)) for c in result.tool_calls] == calls
    assert result.content == content
    for call in result.tool_calls:
        assert call.arguments == json.dumps(json.loads(call.arguments), ensure_ascii=False)
    ids = [c.id for c in result.tool_calls]
    assert len(set(ids)) == len(ids)


@pytest.mark.parametrize(("name", "text"), ALL_SAMPLES)
def test_stream_whole_and_char_by_char(name: str, text: str):
    parser = get_tool_parser(name)
    check_stream(parser, text, [text])
    check_stream(parser, text, list(text))


@settings(max_examples=150, deadline=None)
@given(sample=st.sampled_from(ALL_SAMPLES), cuts=st.lists(st.integers(0, 10_000), max_size=16))
def test_stream_random_splits(sample: tuple[str, str], cuts: list[int]):
    name, text = sample
    check_stream(get_tool_parser(name), text, _pieces(text, cuts))


@settings(max_examples=100, deadline=None)
@given(data=st.data(), name=st.sampled_from(sorted(FRAGMENTS)))
def test_stream_random_texts(data: st.DataObject, name: str):
    text = "".join(data.draw(st.lists(st.sampled_from(FRAGMENTS[name]), max_size=14)))
    cuts = data.draw(st.lists(st.integers(0, 10_000), max_size=10))
    parser = get_tool_parser(name)
    check_stream(parser, text, _pieces(text, cuts))
    check_stream(parser, text, list(text))


@st.composite
def mutated_samples(draw: st.DrawFn) -> tuple[str, str]:
    """A sample output with a few random insertions (format fragments) and deletions."""
    name, text = draw(st.sampled_from(ALL_SAMPLES))
    for _ in range(draw(st.integers(0, 3))):
        at = draw(st.integers(0, len(text)))
        if draw(st.booleans()):
            text = text[:at] + draw(st.sampled_from(FRAGMENTS[name])) + text[at:]
        else:
            text = text[:at] + text[at + draw(st.integers(1, 8)):]
    return name, text


@settings(max_examples=150, deadline=None)
@given(sample=mutated_samples(), cuts=st.lists(st.integers(0, 10_000), max_size=10))
def test_stream_mutated_samples(sample: tuple[str, str], cuts: list[int]):
    name, text = sample
    parser = get_tool_parser(name)
    check_stream(parser, text, _pieces(text, cuts))
    check_stream(parser, text, list(text))


def test_content_passes_through_unless_it_may_start_a_marker():
    stream = get_tool_parser("hermes").stream()
    assert stream.feed("Hello wor").content == "Hello wor"
    assert stream.feed("ld <tool_").content == "ld"  # " " and "<tool_" held back
    assert stream.feed("x").content == " <tool_x"
    assert stream.finish().content is None


def test_call_streams_as_soon_as_complete():
    stream = get_tool_parser("hermes").stream()
    assert stream.feed("<tool_call>\n" + WEATHER[:20]).tool_calls == []
    result = stream.feed(WEATHER[20:] + "\n</tool_call>")
    assert [(d.index, d.name) for d in result.tool_calls] == [(0, "get_weather")]
    assert json.loads(result.tool_calls[0].arguments) == W[1]


def test_unfinished_call_becomes_content_at_finish():
    stream = get_tool_parser("mistral").stream()
    assert stream.feed('[TOOL_CALLS][{"name": "f", "arg').content is None
    result = stream.finish()
    assert result.content == '[TOOL_CALLS][{"name": "f", "arg'
    assert result.tool_calls == []


def test_mistral_ids_are_nine_alphanumerics():
    parser = get_tool_parser("mistral")
    calls = parser.extract_tool_calls(f"[TOOL_CALLS]{M_LIST}").tool_calls
    stream = parser.stream()
    deltas = stream.feed(f"[TOOL_CALLS]{M_LIST}").tool_calls + stream.finish().tool_calls
    ids = [c.id for c in calls] + [d.id for d in deltas]
    assert len(ids) == 4 and all(re.fullmatch(r"[A-Za-z0-9]{9}", i or "") for i in ids)


def test_default_ids_are_openai_style():
    calls = get_tool_parser("hermes").extract_tool_calls(HERMES[1][0]).tool_calls
    assert all(re.fullmatch(r"call_[0-9a-f]{24}", c.id) for c in calls)


TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}},
]
FORMAT_MARKS = {"hermes": "<tool_call>", "llama3_json": '"parameters"',
                "mistral": "[TOOL_CALLS]", "pythonic": "func_name1(param_name1="}


@pytest.mark.parametrize("name", sorted(TOOL_PARSERS))
def test_system_prompt_names_tools_and_format(name: str):
    prompt = get_tool_parser(name).system_prompt(TOOLS)
    assert "get_weather" in prompt and "get_time" in prompt
    assert "Current weather in a city" in prompt
    assert FORMAT_MARKS[name] in prompt


def test_registry_and_unknown_name():
    assert sorted(TOOL_PARSERS) == sorted(FORMAT_MARKS)
    assert all(get_tool_parser(n).name == n for n in TOOL_PARSERS)
    with pytest.raises(ValueError, match="unknown tool-call parser") as info:
        get_tool_parser("nope")
    assert all(n in str(info.value) for n in TOOL_PARSERS)
