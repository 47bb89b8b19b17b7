"""Tool-call parsers: whole-output extraction per format, and streaming that agrees with it.

The streaming property is checked for every sample under random splits into deltas, and for
random texts built from each format's marker fragments (where stream/extract disagreements
would hide): concatenated content deltas equal the extracted content, each call's first delta
carries its id and name, and its argument fragments join to exactly the extracted arguments.
Calls a stream announced early and that then broke (the text stopped in them, or they turned
out malformed) are set aside: they are the only difference a stream may show.
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
SCHEMA_TOOLS = [  # the types qwen3_coder reads its text arguments as
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"},
                                         "unit": {"type": "string"},
                                         "days": {"type": "integer"},
                                         "hot": {"type": "boolean"},
                                         "ratio": {"type": "number"},
                                         "tags": {"type": "array"},
                                         "where": {"type": "object"}}}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"timezone": {"type": "string"}}}}},
]


def parser_for(name: str) -> ToolParser:
    return get_tool_parser(name, SCHEMA_TOOLS)

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

Q_WEATHER = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
             "<parameter=unit>\ncelsius\n</parameter>\n</function>\n</tool_call>")
Q_TIME = ("<tool_call>\n<function=get_time>\n<parameter=timezone>\nEurope/Paris\n"
          "</parameter>\n</function>\n</tool_call>")
QWEN3_CODER: list[Expected] = [
    (Q_WEATHER, [W], None),
    (f"{Q_WEATHER}\n{Q_TIME}", [W, T], None),
    (f"Let me check.\n{Q_WEATHER}", [W], "Let me check."),
    ("The capital of France is Paris.", [], "The capital of France is Paris."),
    (Q_WEATHER.removesuffix("</tool_call>"), [W], None),  # stopped on </tool_call>
    ("<tool_call>\n<function=get_weather>\n<parameter=days>\n3\n</parameter>\n"
     "<parameter=hot>\nTrue\n</parameter>\n<parameter=ratio>\n2.0\n</parameter>\n"
     "<parameter=tags>\n[\"a\", 1]\n</parameter>\n<parameter=where>\n{'x': None}\n"
     "</parameter>\n<parameter=city>\nnull\n</parameter>\n</function>\n</tool_call>",
     [("get_weather", {"days": 3, "hot": True, "ratio": 2, "tags": ["a", 1],
                       "where": {"x": None}, "city": None})], None),
    ("<tool_call><function=get_weather><parameter=days>many</parameter><parameter=note>"
     "two\nlines\n\n</parameter></function></tool_call>",
     [("get_weather", {"days": "many", "note": "two\nlines\n"})], None),
    ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n<parameter=unit>\nc\n"
     "</function>\n</tool_call>", [("get_weather", {"city": "Paris", "unit": "c"})], None),
    ("<tool_call>\n<function=get_time>\n</function>\n</tool_call>", [("get_time", {})], None),
    ("<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n<parameter=a>\n2\n"
     "</parameter>\n</function>\n</tool_call>", [],
     "<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n<parameter=a>\n2\n"
     "</parameter>\n</function>\n</tool_call>"),
    ("<tool_call>\n<function=get_weather>\n<parameter=city>\nPar", [],
     "<tool_call>\n<function=get_weather>\n<parameter=city>\nPar"),
    ("<tool_call><function=bad name></function></tool_call>", [],
     "<tool_call><function=bad name></function></tool_call>"),
    (f"{Q_TIME} Anything else?", [T], "Anything else?"),
    ('<tool_call><function=geo><parameter=city>Zürich</parameter><parameter=note>日本語 🌍 '
     '"quoted"</parameter></function></tool_call>', [("geo", UNICODE_ARGS)], None),
]

SAMPLES: dict[str, list[Expected]] = {
    "hermes": HERMES, "llama3_json": LLAMA3, "mistral": MISTRAL, "pythonic": PYTHONIC,
    "qwen3_coder": QWEN3_CODER,
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
    "qwen3_coder": ["<tool_call>", "</tool_call>", "<function=get_weather>", "<function=f>",
                    "</function>", "<parameter=city>", "<parameter=days>", "</parameter>",
                    "<param", "</func", "null", "Paris", "3", "\n", " ", "x", "<", ">", "/"],
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
    closed = [i for r in results for i in r.closed]
    broken = [i for r in results for i in r.broken]
    assert sorted(closed + broken) == sorted(deltas)  # every call ends, once
    assert closed == sorted(closed) and len(closed) == len(expected.tool_calls)
    for index, call in zip(closed, expected.tool_calls, strict=True):
        first, *later = deltas[index]
        assert first.id and first.name == call.name
        assert all(d.id is None and d.name is None for d in later)
        arguments = "".join(d.arguments or "" for d in deltas[index])
        assert arguments == call.arguments
        assert isinstance(json.loads(arguments), dict)
    for index in broken:  # announced early: a name and the start of an arguments object
        first = deltas[index][0]
        assert first.id and first.name and (first.arguments or "").startswith("{")


@pytest.mark.parametrize(("name", "text", "calls", "content"),
                         [(n, *case) for n, cases in SAMPLES.items() for case in cases])
def test_extract(name: str, text: str, calls: list[tuple[str, dict]], content: str | None):
    result = parser_for(name).extract_tool_calls(text)
    assert result.tools_called == bool(calls)
    assert [(c.name, json.loads(c.arguments)) for c in result.tool_calls] == calls
    assert result.content == content
    for call in result.tool_calls:
        assert call.arguments == json.dumps(json.loads(call.arguments), ensure_ascii=False)
    ids = [c.id for c in result.tool_calls]
    assert len(set(ids)) == len(ids)


@pytest.mark.parametrize(("name", "text"), ALL_SAMPLES)
def test_stream_whole_and_char_by_char(name: str, text: str):
    parser = parser_for(name)
    check_stream(parser, text, [text])
    check_stream(parser, text, list(text))


@settings(max_examples=150, deadline=None)
@given(sample=st.sampled_from(ALL_SAMPLES), cuts=st.lists(st.integers(0, 10_000), max_size=16))
def test_stream_random_splits(sample: tuple[str, str], cuts: list[int]):
    name, text = sample
    check_stream(parser_for(name), text, _pieces(text, cuts))


@settings(max_examples=100, deadline=None)
@given(data=st.data(), name=st.sampled_from(sorted(FRAGMENTS)))
def test_stream_random_texts(data: st.DataObject, name: str):
    text = "".join(data.draw(st.lists(st.sampled_from(FRAGMENTS[name]), max_size=14)))
    cuts = data.draw(st.lists(st.integers(0, 10_000), max_size=10))
    parser = parser_for(name)
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
    parser = parser_for(name)
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


LONG_ARGS = {"city": "Paris", "note": "a fairly long note, \"quoted\" and\nsplit", "days": 3,
             "tags": ["x", {"y": None}], "hot": False}
STREAMED = {
    "hermes": "Checking.\n<tool_call>\n" + json.dumps(
        {"name": "get_weather", "arguments": LONG_ARGS}, indent=1) + "\n</tool_call>",
    "llama3_json": json.dumps({"name": "get_weather", "parameters": LONG_ARGS},
                              separators=(",", ":")),
    "mistral": "[TOOL_CALLS]" + json.dumps([{"name": "get_weather", "arguments": LONG_ARGS},
                                           {"name": "get_time", "arguments": T[1]}]),
    "mistral_args": '[TOOL_CALLS]get_weather[ARGS]' + json.dumps(LONG_ARGS, indent=2),
    "qwen3_coder": "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>"
                   "\n<parameter=note>\na fairly long note, \"quoted\" and\nsplit\n</parameter>"
                   "\n<parameter=days>\n3\n</parameter>\n<parameter=tags>\n[\"x\", {\"y\": null}]"
                   "\n</parameter>\n<parameter=hot>\nfalse\n</parameter>\n</function>\n"
                   "</tool_call>",
}


@pytest.mark.parametrize("case", sorted(STREAMED))
def test_arguments_stream_as_they_are_generated(case: str):
    """Token by token, a call is announced once its name is known, long before it ends, and
    its arguments arrive in many deltas that join to exactly the whole output's."""
    parser, text = parser_for(case.removesuffix("_args")), STREAMED[case]
    expected = parser.extract_tool_calls(text).tool_calls
    assert json.loads(expected[0].arguments) == LONG_ARGS
    stream = parser.stream()
    announced_at, arguments = None, {}
    pieces: dict[int, int] = {}
    for fed, ch in enumerate(text, 1):
        for d in stream.feed(ch).tool_calls:
            announced_at = fed if announced_at is None else announced_at
            arguments[d.index] = arguments.get(d.index, "") + (d.arguments or "")
            pieces[d.index] = pieces.get(d.index, 0) + 1
    for d in stream.finish().tool_calls:
        arguments[d.index] = arguments.get(d.index, "") + (d.arguments or "")
    assert [arguments[i] for i in sorted(arguments)] == [c.arguments for c in expected]
    assert announced_at is not None and announced_at < len(text) / 2
    assert pieces[0] >= 10


def test_a_call_broken_after_its_announcement():
    stream = parser_for("hermes").stream()
    text = '<tool_call>{"name": "f", "arguments": {"a": 1, "b": "x'
    first = stream.feed(text)
    assert [(d.index, d.name, d.arguments) for d in first.tool_calls] == [
        (0, "f", '{"a": 1, "b": "x')]
    last = stream.finish()  # the output stopped in it: the whole output reads it as content
    assert last.broken == [0] and last.closed == [] and last.content == text
    assert not parser_for("hermes").extract_tool_calls(text).tools_called


def test_duplicate_keys_and_two_argument_keys_are_no_call():
    for body in ('{"name": "f", "arguments": {"a": 1, "a": 2}}',
                 '{"name": "f", "arguments": {}, "parameters": {}}'):
        result = parser_for("hermes").extract_tool_calls(f"<tool_call>{body}</tool_call>")
        assert not result.tools_called


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
                "mistral": "[TOOL_CALLS]", "pythonic": "func_name1(param_name1=",
                "qwen3_coder": "<function="}


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
