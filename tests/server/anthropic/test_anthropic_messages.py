"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens) through the official
`anthropic` client, against the embedded SmolLM2: answers, streams, tool use, token counts and
errors in Anthropic's shape. The client no longer takes sampling fields as arguments, so greedy
decoding goes in extra_body."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import jsonschema
import pytest

from octavo.server.anthropic.serving import BlockEvents, stop_reason, to_message
from octavo.server.protocol import (
    ChatChoice,
    ChatCompletionResponse,
    ChatResponseMessage,
    DeltaMessage,
    UsageInfo,
)
from octavo.server.protocol_agent import (
    DeltaFunctionCall,
    DeltaToolCall,
    FunctionCallOut,
    ToolCallOut,
)
from tests.server.conftest import API_KEY, RunningServer, start_server, stop_server

MODEL = "smollm2"
GREEDY = {"temperature": 0}
WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}},
                  "required": ["city"], "additionalProperties": False}
TOOLS = [{"name": "get_weather", "description": "Get the current weather in a city",
          "input_schema": WEATHER_SCHEMA}]
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]
SAY_HELLO = [{"role": "user", "content": "Say hello."}]


@pytest.fixture(scope="module")
def server(default_model_dir) -> Iterator[RunningServer]:
    s = start_server(default_model_dir, name=MODEL, num_kv_blocks=256, max_model_len=2048,
                     enable_auto_tool_choice=True, tool_call_parser="hermes")
    yield s
    stop_server(s)


@pytest.fixture(scope="module")
def client(server: RunningServer) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)


def count(client: anthropic.Anthropic, **request: Any) -> int:
    prompt = {k: v for k, v in request.items() if k in ("messages", "system", "tools",
                                                         "tool_choice")}
    return client.messages.count_tokens(model=MODEL, **prompt).input_tokens


def text_of(message: anthropic.types.Message) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


def test_text_answer_with_usage_and_end_turn(client: anthropic.Anthropic) -> None:
    request = dict(max_tokens=40, messages=SAY_HELLO,
                   system=[{"type": "text", "text": "You are a friendly assistant."}])
    r = client.messages.create(model=MODEL, **request, extra_body=GREEDY)
    assert r.type == "message" and r.role == "assistant" and r.model == MODEL
    assert r.id.startswith("msg_")
    assert [b.type for b in r.content] == ["text"] and "hello" in text_of(r).lower()
    assert r.stop_reason == "end_turn" and r.stop_sequence is None
    assert 0 < r.usage.output_tokens < 40
    assert r.usage.input_tokens == count(client, **request) != count(client, messages=SAY_HELLO)


def test_max_tokens_and_stop_sequences(client: anthropic.Anthropic) -> None:
    cut = client.messages.create(model=MODEL, max_tokens=5, messages=SAY_HELLO,
                                 extra_body=GREEDY)
    assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 5
    stopped = client.messages.create(model=MODEL, max_tokens=40, messages=SAY_HELLO,
                                     stop_sequences=["!", " there"], extra_body=GREEDY)
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == " there"
    assert text_of(stopped) == "Hello"  # the matched stop string is not part of the text


def test_a_final_assistant_message_is_continued(client: anthropic.Anthropic) -> None:
    prefill = [*SAY_HELLO, {"role": "assistant", "content": "Bonjour"}]
    r = client.messages.create(model=MODEL, max_tokens=8, messages=prefill, extra_body=GREEDY)
    assert r.usage.input_tokens == count(client, messages=prefill)
    whole = client.messages.create(model=MODEL, max_tokens=8, messages=SAY_HELLO,
                                   extra_body=GREEDY)
    assert text_of(r) != text_of(whole)


def test_stream_adds_up_to_the_message(client: anthropic.Anthropic) -> None:
    request = dict(model=MODEL, max_tokens=20, messages=SAY_HELLO, extra_body=GREEDY)
    with client.messages.stream(**request) as stream:
        events = list(stream)
        final = stream.get_final_message()
    text = "".join(e.delta.text for e in events if e.type == "content_block_delta")
    assert text == text_of(final) == text_of(client.messages.create(**request))
    start = events[0]
    assert start.type == "message_start" and start.message.content == []
    assert start.message.usage.input_tokens == count(client, messages=SAY_HELLO)
    assert [e.type for e in events if e.type not in ("content_block_delta", "text")] == [
        "message_start", "content_block_start", "content_block_stop", "message_delta",
        "message_stop"]
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 20
    assert final.usage.input_tokens == start.message.usage.input_tokens


def test_named_tool_choice_gives_a_valid_tool_use(client: anthropic.Anthropic) -> None:
    r = client.messages.create(model=MODEL, max_tokens=40, messages=ASK_WEATHER, tools=TOOLS,
                               tool_choice={"type": "tool", "name": "get_weather"},
                               extra_body=GREEDY)
    [call] = r.content
    assert call.type == "tool_use" and call.name == "get_weather"
    assert call.id.startswith("toolu_")
    jsonschema.validate(call.input, WEATHER_SCHEMA)
    assert r.stop_reason == "tool_use"
    assert r.usage.input_tokens == count(client, messages=ASK_WEATHER, tools=TOOLS,
                                         tool_choice={"type": "tool", "name": "get_weather"})


def test_any_tool_choice_gives_a_valid_tool_use(client: anthropic.Anthropic) -> None:
    choice = {"type": "any", "disable_parallel_tool_use": True}
    r = client.messages.create(model=MODEL, max_tokens=40, messages=ASK_WEATHER, tools=TOOLS,
                               tool_choice=choice, extra_body=GREEDY)
    [call] = [b for b in r.content if b.type == "tool_use"]
    assert call.name == "get_weather" and r.stop_reason == "tool_use"
    jsonschema.validate(call.input, WEATHER_SCHEMA)


def _answer_turn(call: Any) -> list[dict[str, Any]]:
    """The conversation after a call: the assistant's tool_use, then its result."""
    return [*ASK_WEATHER,
            {"role": "assistant", "content": [{"type": "tool_use", "id": call.id,
                                               "name": call.name, "input": call.input}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": call.id,
                 "content": [{"type": "text", "text": '{"temperature_c": 21, "sky": "clear"}'}]},
                {"type": "text", "text": "Answer in one sentence."}]}]


def test_tool_loop(client: anthropic.Anthropic) -> None:
    first = client.messages.create(model=MODEL, max_tokens=40, messages=ASK_WEATHER,
                                   tools=TOOLS, tool_choice={"type": "tool",
                                                             "name": "get_weather"},
                                   extra_body=GREEDY)
    followup = dict(messages=_answer_turn(first.content[0]), tools=TOOLS,
                    tool_choice={"type": "none"})
    answer = client.messages.create(model=MODEL, max_tokens=30, **followup, extra_body=GREEDY)
    assert [b.type for b in answer.content] == ["text"] and text_of(answer).strip()
    assert answer.stop_reason in ("end_turn", "max_tokens")
    assert answer.usage.input_tokens == count(client, **followup)


def test_tool_loop_streamed(client: anthropic.Anthropic) -> None:
    with client.messages.stream(model=MODEL, max_tokens=40, messages=ASK_WEATHER, tools=TOOLS,
                                tool_choice={"type": "tool", "name": "get_weather"},
                                extra_body=GREEDY) as stream:
        events = list(stream)
        first = stream.get_final_message()
    partial = "".join(e.delta.partial_json for e in events
                      if e.type == "content_block_delta" and e.delta.type == "input_json_delta")
    [call] = first.content
    assert call.type == "tool_use" and json.loads(partial) == call.input
    jsonschema.validate(call.input, WEATHER_SCHEMA)
    assert first.stop_reason == "tool_use"
    with client.messages.stream(model=MODEL, max_tokens=30, messages=_answer_turn(call),
                                tools=TOOLS, tool_choice={"type": "auto"},
                                extra_body=GREEDY) as stream:
        text = "".join(stream.text_stream)
        answer = stream.get_final_message()
    assert text.strip() and text == text_of(answer)
    assert answer.stop_reason in ("end_turn", "max_tokens", "tool_use")


def test_a_stream_left_early_is_cancelled(client: anthropic.Anthropic,
                                          server: RunningServer) -> None:
    with client.messages.stream(model=MODEL, max_tokens=200, messages=SAY_HELLO) as stream:
        next(iter(stream.text_stream))
    assert server.wait_idle()["vllm:num_requests_running"] == 0


def _bad_request(call: Any) -> str:
    with pytest.raises(anthropic.BadRequestError) as info:
        call()
    assert info.value.body["type"] == "error"
    assert info.value.body["error"]["type"] == "invalid_request_error"
    return info.value.body["error"]["message"]


def test_errors_are_in_anthropics_shape(client: anthropic.Anthropic,
                                        server: RunningServer) -> None:
    def create(**request: Any) -> Any:
        return client.messages.create(model=MODEL, max_tokens=8, **request)

    # the client insists on max_tokens: post the body as is
    assert "max_tokens" in _bad_request(lambda: client.post(
        "/v1/messages", body={"model": MODEL, "messages": SAY_HELLO},
        cast_to=anthropic.types.Message))
    answer = _answer_turn(anthropic.types.ToolUseBlock(
        type="tool_use", id="toolu_1", name="get_weather", input={"city": "Paris"}))
    answer[-1]["content"][0]["tool_use_id"] = "toolu_unknown"
    assert "toolu_unknown" in _bad_request(lambda: create(messages=answer, tools=TOOLS,
                                                          tool_choice={"type": "none"}))
    assert "get_time" in _bad_request(lambda: create(
        messages=ASK_WEATHER, tools=TOOLS, tool_choice={"type": "tool", "name": "get_time"}))
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": "iVBORw0KGgo="}}
    assert "image content is not supported" in _bad_request(lambda: create(
        messages=[{"role": "user", "content": [image, {"type": "text", "text": "What?"}]}]))
    assert "temperature" in _bad_request(lambda: create(messages=SAY_HELLO,
                                                        extra_body={"temperature": 7}))
    assert "messages" in _bad_request(lambda: client.messages.count_tokens(model=MODEL,
                                                                           messages=[]))
    broken = httpx.post(f"{server.url}/v1/messages", content=b'{"model": ',
                        headers={"content-type": "application/json"})
    assert broken.status_code == 400 and broken.json()["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.NotFoundError) as info:
        client.messages.create(model="claude-opus-4-0", max_tokens=8, messages=SAY_HELLO)
    assert info.value.body["error"]["type"] == "not_found_error"


def test_reasoning_text_and_calls_become_blocks_in_order() -> None:
    """No served model here thinks: the translation of a thinking answer on its own."""
    blocks = BlockEvents()
    deltas = [DeltaMessage(reasoning_content="Paris? "), DeltaMessage(reasoning_content="Yes."),
              DeltaMessage(content="Checking."),
              DeltaMessage(tool_calls=[DeltaToolCall(index=0, id="call_1", type="function",
                                                     function=DeltaFunctionCall(
                                                         name="get_weather", arguments='{"ci'))]),
              DeltaMessage(tool_calls=[DeltaToolCall(index=0, function=DeltaFunctionCall(
                  arguments='ty": "Paris"}'))])]
    events = [e for d in deltas for e in blocks.feed(d)] + blocks.close()
    parsed = [json.loads(e.split("data: ", 1)[1]) for e in events]
    assert [e.split("\n", 1)[0] for e in events] == [f"event: {p['type']}" for p in parsed]
    starts = [p["content_block"] for p in parsed if p["type"] == "content_block_start"]
    assert [b["type"] for b in starts] == ["thinking", "text", "tool_use"]
    assert starts[2]["id"] == "toolu_1" and starts[2]["name"] == "get_weather"
    deltas_of = {i: [p["delta"] for p in parsed if p.get("index") == i and "delta" in p]
                 for i in range(3)}
    assert "".join(d["thinking"] for d in deltas_of[0]) == "Paris? Yes."
    assert json.loads("".join(d["partial_json"] for d in deltas_of[2])) == {"city": "Paris"}
    assert [p["index"] for p in parsed if p["type"] == "content_block_stop"] == [0, 1, 2]
    assert blocks.called and stop_reason("stop", None, blocks.called) == ("tool_use", None)
    whole = to_message(ChatCompletionResponse(id="chatcmpl-1", model=MODEL, choices=[
        ChatChoice(index=0, finish_reason="stop", message=ChatResponseMessage(
            reasoning_content="Paris? Yes.", content="Checking.", tool_calls=[ToolCallOut(
                id="call_1", function=FunctionCallOut(name="get_weather",
                                                      arguments='{"city": "Paris"}'))]))],
        usage=UsageInfo(prompt_tokens=3, completion_tokens=4, total_tokens=7)), MODEL)
    assert [b.type for b in whole.content] == ["thinking", "text", "tool_use"]
    assert whole.stop_reason == "tool_use" and whole.id == "msg_1"
    assert whole.usage.input_tokens == 3 and whole.usage.output_tokens == 4


def test_every_kv_block_is_back(server: RunningServer) -> None:
    assert server.wait_idle()["octavo:kv_blocks_used"] == 0


def test_x_api_key_is_accepted(auth_server: RunningServer) -> None:
    messages = [{"role": "user", "content": "hi"}]
    keyed = anthropic.Anthropic(base_url=auth_server.url, api_key=API_KEY, max_retries=0)
    assert keyed.messages.count_tokens(model="tiny", messages=messages).input_tokens > 0
    wrong = anthropic.Anthropic(base_url=auth_server.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError):
        wrong.messages.count_tokens(model="tiny", messages=messages)
    bearer = httpx.post(f"{auth_server.url}/v1/messages/count_tokens",
                        json={"model": "tiny", "messages": messages},
                        headers={"Authorization": f"Bearer {API_KEY}"})
    assert bearer.status_code == 200
