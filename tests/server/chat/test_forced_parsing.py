"""The reasoning and tool-call parsers end to end, on outputs forced by a regex constraint.

The tiny random-weight model says nothing useful, but a `structured_outputs` regex makes it
write exactly the `<think>` blocks and hermes `<tool_call>`s a real model would, so the whole
path (engine, constraint, parsers, OpenAI response and stream shapes) runs for real.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import openai
import pytest

from tests.conftest import build_tiny_llama
from tests.server.conftest import RunningServer, start_server, stop_server

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
HERMES_CALL = (r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)"\}\}'
               r"\n</tool_call>")


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[RunningServer]:
    # room for the tool instructions the server adds (this template does not render tools)
    model = build_tiny_llama(tmp_path_factory.mktemp("tiny-2k"), max_position_embeddings=2048)
    s = start_server(model, num_kv_blocks=512, reasoning_parser="qwen3",
                     enable_auto_tool_choice=True, tool_call_parser="hermes")
    yield s
    stop_server(s)


@pytest.fixture(scope="module")
def client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0)


def chat(client: openai.OpenAI, regex: str, **kw):
    return client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "go"}], max_tokens=120,
        temperature=1.0, seed=7, extra_body={"structured_outputs": {"regex": regex}}, **kw)


def test_reasoning_is_split_from_content(client: openai.OpenAI) -> None:
    r = chat(client, r"<think>[a-z]{6}</think>[a-z]{5}")
    m = r.choices[0].message
    assert len(m.reasoning_content) == 6 and m.reasoning_content.isalpha()
    assert len(m.content) == 5 and "<think>" not in m.content
    assert r.choices[0].finish_reason == "stop"


def test_streamed_reasoning_adds_up_to_the_whole(client: openai.OpenAI) -> None:
    whole = chat(client, r"<think>[a-z]{6}</think>[a-z]{5}").choices[0].message
    reasoning, content = "", ""
    for chunk in chat(client, r"<think>[a-z]{6}</think>[a-z]{5}", stream=True):
        for c in chunk.choices:
            reasoning += c.delta.model_extra.get("reasoning_content") or ""
            content += c.delta.content or ""
    assert (reasoning, content) == (whole.reasoning_content, whole.content)


def test_auto_tool_calls_are_read_by_the_hermes_parser(client: openai.OpenAI) -> None:
    r = chat(client, "[a-z]{3}" + HERMES_CALL, tools=[WEATHER])
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.type == "function"
    assert json.loads(call.function.arguments)["city"] in ("Paris", "Rome")
    assert len(choice.message.content) == 3  # the text before the call


def test_streamed_auto_tool_calls_match_the_whole(client: openai.OpenAI) -> None:
    whole = chat(client, "[a-z]{3}" + HERMES_CALL, tools=[WEATHER]).choices[0]
    content, calls, finish = "", {}, None
    for chunk in chat(client, "[a-z]{3}" + HERMES_CALL, tools=[WEATHER], stream=True):
        for c in chunk.choices:
            content += c.delta.content or ""
            finish = c.finish_reason or finish
            for d in c.delta.tool_calls or []:
                if d.index not in calls:
                    assert d.id and d.function.name and d.type == "function"
                    calls[d.index] = {"name": d.function.name, "arguments": ""}
                calls[d.index]["arguments"] += d.function.arguments or ""
    assert finish == "tool_calls" and content == whole.message.content
    assert [c["name"] for c in calls.values()] == ["get_weather"]
    assert calls[0]["arguments"] == whole.message.tool_calls[0].function.arguments


def test_tool_choice_none_leaves_call_text_as_content(client: openai.OpenAI) -> None:
    r = chat(client, HERMES_CALL, tools=[WEATHER], tool_choice="none")
    assert r.choices[0].message.tool_calls in (None, [])
    assert r.choices[0].message.content.startswith("<tool_call>")
    assert r.choices[0].finish_reason == "stop"


def test_no_block_is_left_behind(server: RunningServer) -> None:
    assert server.wait_idle()["octavo:kv_blocks_used"] == 0
