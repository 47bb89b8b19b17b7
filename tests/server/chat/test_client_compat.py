"""What agent clients and vLLM tooling rely on in chat completions, with the official openai
SDK against a real server on the tiny random-weight model, its outputs scripted by a regex
constraint: the SDK's `chat.completions.stream()` helper (it merges deltas key by key, so a
continuation chunk must not carry `"type": null`), tool arguments streamed as they are
generated, `prompt_tokens_details.cached_tokens`, `cache_salt`, and the reasoning budget.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.conftest import build_tiny_llama
from tests.server.conftest import RunningServer, start_server, stop_server

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city", "strict": True,
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                   "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}}}}}
NOTE = {"type": "function", "function": {
    "name": "note", "description": "Keep a note", "strict": True,
    "parameters": {"type": "object", "additionalProperties": False, "required": ["text"],
                   "properties": {"text": {"type": "string"}}}}}
HERMES_NOTE = (r'<tool_call>\n\{"name": "note", "arguments": \{"text": "[a-z]{12}"\}\}'
               r"\n</tool_call>")
THINK = r"<think>[a-z]{1,12}</think>[a-z]{2}"
DEFAULT_BUDGET = 4


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[RunningServer]:
    model = build_tiny_llama(tmp_path_factory.mktemp("tiny-2k"), max_position_embeddings=2048)
    s = start_server(model, num_kv_blocks=512, reasoning_parser="qwen3",
                     enable_auto_tool_choice=True, tool_call_parser="hermes",
                     reasoning_budget=DEFAULT_BUDGET)
    yield s
    stop_server(s)


@pytest.fixture(scope="module")
def client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0)


GO = [{"role": "user", "content": "go"}]


def test_sdk_stream_helper_with_a_named_tool(client: openai.OpenAI) -> None:
    with client.chat.completions.stream(
            model="tiny", messages=GO, tools=[WEATHER], max_tokens=40, temperature=1.0, seed=3,
            tool_choice={"type": "function", "function": {"name": "get_weather"}}) as stream:
        deltas = [e for e in stream if e.type == "tool_calls.function.arguments.delta"]
        final = stream.get_final_completion()
    (call,) = final.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and len(deltas) > 1
    assert call.function.parsed_arguments == json.loads(call.function.arguments)
    assert call.function.parsed_arguments["city"] in ("Paris", "Rome")


NOTE_REQUEST = dict(model="tiny", messages=GO, tools=[NOTE], max_tokens=120, temperature=1.0,
                    seed=5, extra_body={"structured_outputs": {"regex": HERMES_NOTE}})


@pytest.fixture(scope="module")
def whole(client: openai.OpenAI):
    """The scripted auto call, not streamed."""
    return client.chat.completions.create(**NOTE_REQUEST).choices[0].message.tool_calls[0]


def test_sdk_stream_helper_with_an_auto_tool(client: openai.OpenAI, whole) -> None:
    """The model's call is read by the hermes parser; its arguments arrive in many deltas as
    they are generated, and add up to the arguments of the same output whole."""
    with client.chat.completions.stream(**NOTE_REQUEST) as stream:
        deltas = [e.arguments_delta for e in stream
                  if e.type == "tool_calls.function.arguments.delta"]
        final = stream.get_final_completion()
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "note" and call.function.arguments == whole.function.arguments
    # a stream keeps only its newest output for a reader that falls behind, so on a loaded
    # machine deltas merge: how many arrive varies, but never all in one
    assert len(deltas) >= 2 and "".join(deltas) == whole.function.arguments
    assert len(call.function.parsed_arguments["text"]) == 12


def test_continuation_chunks_carry_no_null_fields(server: RunningServer, whole) -> None:
    body = {**{k: v for k, v in NOTE_REQUEST.items() if k != "extra_body"},
            **NOTE_REQUEST["extra_body"], "stream": True}
    calls = []
    with httpx.stream("POST", f"{server.v1}/chat/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    calls += c["delta"].get("tool_calls") or []
    first, *rest = calls
    assert set(first) == {"index", "id", "type", "function"} and first["type"] == "function"
    assert rest and all(d.keys() == {"index", "function"} for d in rest)
    assert all(d["function"].keys() == {"arguments"} for d in rest)
    assert "".join(d["function"]["arguments"] for d in calls) == whole.function.arguments


def test_cached_tokens_and_cache_salt(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "a shared prefix of some length " * 8}]

    def cached(**kw) -> int:
        r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=1, **kw)
        return r.usage.prompt_tokens_details.cached_tokens

    assert cached(extra_body={"cache_salt": "first"}) == 0
    again = cached(extra_body={"cache_salt": "first"})
    assert again >= 200 and again % 16 == 0  # whole blocks of the same salt's prompt
    assert cached(extra_body={"cache_salt": "second"}) == 0  # another salt shares no block
    assert cached() == 0  # nor does no salt
    assert cached() == again
    stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=1,
                                            stream=True, stream_options={"include_usage": True})
    usage = [c.usage for c in stream if c.usage is not None][-1]
    assert usage.prompt_tokens_details.cached_tokens == again


def test_an_empty_cache_salt_is_refused(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="cache_salt"):
        client.chat.completions.create(model="tiny", messages=GO, max_tokens=1,
                                       extra_body={"cache_salt": ""})


def reasoning(client: openai.OpenAI, **extra) -> tuple[str, str]:
    m = client.chat.completions.create(
        model="tiny", messages=GO, max_tokens=30, temperature=1.0, seed=11,
        extra_body={"structured_outputs": {"regex": THINK}, **extra}).choices[0].message
    return m.model_extra["reasoning_content"], m.content


def test_reasoning_budget(client: openai.OpenAI) -> None:
    """Once the budget is spent, `</think>` is forced; the answer follows."""
    free, _ = reasoning(client, thinking_token_budget=1000)
    assert len(free) > DEFAULT_BUDGET  # this seed thinks longer than the budgets below
    by_default, answer = reasoning(client)  # --reasoning-budget
    assert 1 <= len(by_default) <= DEFAULT_BUDGET and len(answer) == 2
    assert free.startswith(by_default)
    short, answer = reasoning(client, thinking_token_budget=2)
    assert 1 <= len(short) <= 2 and len(answer) == 2
