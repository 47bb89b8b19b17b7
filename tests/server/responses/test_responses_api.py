"""POST/GET/DELETE /v1/responses with the official `openai` SDK against a real server (the
embedded SmolLM2), plus the event builder and the store on their own.

The server keeps at most 3 responses, so the store's bound is visible in a few requests.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import openai
import pytest
from openai.types.responses import Response as SDKResponse

from octavo.server.protocol import (
    ChatCompletionChunk,
    ChatResponseMessage,
    ChatStreamChoice,
    DeltaMessage,
    UsageInfo,
)
from octavo.server.protocol_agent import (
    DeltaFunctionCall,
    DeltaToolCall,
    FunctionCallOut,
    ToolCallOut,
)
from octavo.server.responses.events import ResponseEvents
from octavo.server.responses.store import ResponseStore, StoredResponse
from tests.server.conftest import RunningServer, start_server, stop_server

MODEL = "smollm2"
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Tokyo"]},
                   "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [{"type": "function", "name": "get_weather", "description": "The weather now",
                     "parameters": WEATHER, "strict": True}]
NAMED = {"type": "function", "name": "get_weather"}


@pytest.fixture(scope="module")
def server(default_model_dir) -> Iterator[RunningServer]:
    s = start_server(default_model_dir, name=MODEL, num_kv_blocks=256, max_model_len=2048,
                     enable_auto_tool_choice=True, tool_call_parser="hermes",
                     max_stored_responses=3)
    yield s
    stop_server(s)


@pytest.fixture(scope="module")
def client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0)


def create(client: openai.OpenAI, **kwargs: Any) -> Any:
    return client.responses.create(model=MODEL, **{"temperature": 0, "max_output_tokens": 12,
                                                   **kwargs})


# ---- whole responses --------------------------------------------------------------------------
def test_text_response_and_usage(client: openai.OpenAI) -> None:
    r = create(client, input="Say hello to Ada.")
    assert r.object == "response" and r.id.startswith("resp_") and r.model == MODEL
    assert r.status in ("completed", "incomplete") and r.error is None
    assert r.output_text.strip()
    message = r.output[-1]
    assert message.type == "message" and message.role == "assistant"
    assert message.id.startswith("msg_") and message.content[0].type == "output_text"
    u = r.usage
    assert u.input_tokens > 0 and 0 < u.output_tokens <= 12
    assert u.total_tokens == u.input_tokens + u.output_tokens
    assert u.input_tokens_details.cached_tokens == 0
    assert u.output_tokens_details.reasoning_tokens == 0
    assert r.temperature == 0 and r.max_output_tokens == 12 and r.store is True
    assert r.truncation == "disabled" and r.text.format.type == "text"


def test_max_output_tokens_makes_it_incomplete(client: openai.OpenAI) -> None:
    r = create(client, input="Tell me a long story about a lighthouse.", max_output_tokens=3)
    assert r.status == "incomplete"
    assert r.incomplete_details is not None
    assert r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 3 and r.output[-1].status == "incomplete"


def test_json_schema_format(client: openai.OpenAI) -> None:
    schema = {"type": "object",
              "properties": {"name": {"type": "string", "enum": ["Ada", "Alan"]},
                             "age": {"type": "integer", "minimum": 0, "maximum": 150}},
              "required": ["name", "age"], "additionalProperties": False}
    r = create(client, input="Describe Ada Lovelace as JSON with her name and age.",
               max_output_tokens=64,
               text={"format": {"type": "json_schema", "name": "person", "schema": schema,
                                "strict": True}})
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), schema)
    assert r.text.format.type == "json_schema" and r.text.format.name == "person"


def test_instructions_items_and_previous_response(client: openai.OpenAI) -> None:
    first = create(client, instructions="You are terse.", input=[
        {"role": "user", "content": [{"type": "input_text", "text": "My name is Ada."}]},
    ])
    assert first.instructions == "You are terse." and first.output_text
    second = create(client, previous_response_id=first.id,
                    input=[{"type": "message", "role": "user", "content": "What is my name?"}])
    assert second.previous_response_id == first.id and second.instructions is None
    # the stored conversation (input and output of the first) comes before the new input
    assert second.usage.input_tokens > first.usage.input_tokens
    got = client.responses.retrieve(second.id)
    assert got.id == second.id and got.output_text == second.output_text


def test_unknown_previous_response_id(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as e:
        create(client, input="hi", previous_response_id="resp_nothing_here")
    assert e.value.param == "previous_response_id"


def test_store_bound_store_false_and_delete(client: openai.OpenAI) -> None:
    unstored = create(client, input="Hello", max_output_tokens=2, store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    ids = [create(client, input=f"Count to {i}", max_output_tokens=2).id for i in range(4)]
    with pytest.raises(openai.NotFoundError):  # the server keeps 3: the first is gone
        client.responses.retrieve(ids[0])
    assert [client.responses.retrieve(i).id for i in ids[1:]] == ids[1:]
    with pytest.raises(openai.NotFoundError):  # and it cannot be continued either
        create(client, input="more", previous_response_id=ids[0])
    deleted = client.responses.delete(ids[3])
    assert deleted is None  # the SDK returns nothing; the body is checked below
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(ids[3])
    body = client.delete(f"/responses/{ids[2]}", cast_to=object)
    assert body == {"id": ids[2], "object": "response.deleted", "deleted": True}
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(ids[2])


def test_function_call_then_its_output(client: openai.OpenAI) -> None:
    r = create(client, input="What is the weather in Paris?", tools=TOOLS, tool_choice=NAMED,
               max_output_tokens=32)
    calls = [o for o in r.output if o.type == "function_call"]
    assert len(calls) == 1 and r.status == "completed"
    call = calls[0]
    assert call.name == "get_weather" and call.call_id and call.id.startswith("fc_")
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    assert r.tools[0].name == "get_weather" and r.tool_choice.name == "get_weather"
    result = {"type": "function_call_output", "call_id": call.call_id,
              "output": "Sunny, 21 degrees celsius."}
    follow = create(client, previous_response_id=r.id, input=[result])
    assert follow.output_text.strip()
    assert all(o.type == "message" for o in follow.output)
    # the same conversation sent whole, the call item as the SDK gave it back
    whole = create(client, input=[{"role": "user", "content": "What is the weather in Paris?"},
                                  call.model_dump(exclude_none=True), result])
    assert whole.output_text.strip()


def test_hosted_tools_are_left_out_and_namespaces_opened(client: openai.OpenAI) -> None:
    """What Codex sends: function tools, a namespace of functions and a hosted web_search."""
    tools = [{"type": "web_search", "external_web_access": True},
             {"type": "namespace", "name": "weather", "description": "Weather tools",
              "tools": TOOLS}]
    r = create(client, input="What is the weather in Paris?", tools=tools, tool_choice=NAMED,
               max_output_tokens=32)
    assert [t.name for t in r.tools] == ["get_weather"]
    (call,) = [o for o in r.output if o.type == "function_call"]
    jsonschema.validate(json.loads(call.arguments), WEATHER)


# ---- streams ---------------------------------------------------------------------------------
def test_stream_text_events(client: openai.OpenAI) -> None:
    events = list(create(client, input="Say hello to Ada.", stream=True))
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert types.index("response.output_item.added") < types.index(
        "response.content_part.added") < types.index("response.output_text.delta")
    assert types.index("response.output_text.done") < types.index(
        "response.content_part.done") < types.index("response.output_item.done")
    final = events[-1].response
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text and text == final.output_text
    done = next(e for e in events if e.type == "response.output_text.done")
    assert done.text == text and final.usage.output_tokens > 0
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    assert client.responses.retrieve(final.id).output_text == text


def test_stream_function_call_events(client: openai.OpenAI) -> None:
    events = list(create(client, input="What is the weather in Rome?", tools=TOOLS,
                         tool_choice=NAMED, max_output_tokens=32, stream=True))
    assert events[-1].type == "response.completed"
    final = events[-1].response
    call = next(o for o in final.output if o.type == "function_call")
    deltas = "".join(e.delta for e in events
                     if e.type == "response.function_call_arguments.delta")
    assert deltas == call.arguments
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert done.arguments == call.arguments and done.item_id == call.id
    jsonschema.validate(json.loads(call.arguments), WEATHER)


def test_stream_helper_final_response(client: openai.OpenAI) -> None:
    with client.responses.stream(model=MODEL, input="Name a colour.", temperature=0,
                                 max_output_tokens=12,
                                 instructions="Answer in one word.") as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert final.status == "completed"
    assert "".join(deltas) == final.output_text and final.output_text


def test_a_failed_model_step(server: RunningServer, client: openai.OpenAI) -> None:
    runner = server.engine.engine.runner
    real = runner.execute
    calls = {"n": 0}

    def flaky(plan: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 3:  # a decode step
            raise RuntimeError("injected device error")
        return real(plan)

    runner.execute = flaky
    try:
        events = list(create(client, input="Count to ten.", stream=True))
        calls["n"] = 0
        with pytest.raises(openai.InternalServerError) as error:
            create(client, input="Count to ten.")
    finally:
        runner.execute = real
    assert "injected device error" in str(error.value.body)
    assert [ev.sequence_number for ev in events] == list(range(len(events)))
    failed = events[-1]
    assert failed.type == "response.failed" and failed.response.status == "failed"
    assert "injected device error" in failed.response.error.message
    with pytest.raises(openai.NotFoundError):  # a failed response is not stored
        client.responses.retrieve(failed.response.id)


# ---- errors ----------------------------------------------------------------------------------
@pytest.mark.parametrize(("kwargs", "words"), [
    ({"input": [{"role": "user", "content": [
        {"type": "input_text", "text": "what is this?"},
        {"type": "input_image", "image_url": "https://example.com/a.png"}]}]},
     "input_image"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x",
                                         "schema": {"type": "no-such-type"}}}},
     "no-such-type"),
    ({"input": [{"type": "function_call_output", "call_id": "call_nope", "output": "1"}]},
     "call_nope"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "item_reference"),
    ({"input": "hi", "tool_choice": NAMED}, "tool"),
])
def test_bad_requests_are_400_in_openai_shape(client: openai.OpenAI, kwargs: dict[str, Any],
                                              words: str) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        create(client, **kwargs)
    body = e.value.body
    assert isinstance(body, dict) and body["type"] == "BadRequestError" and body["code"] == 400
    assert words in body["message"]


# ---- the event builder and the store, on their own --------------------------------------------
def _chunk(delta: DeltaMessage | None = None, finish: str | None = None,
           usage: UsageInfo | None = None) -> ChatCompletionChunk:
    choices = [] if delta is None else [ChatStreamChoice(index=0, delta=delta,
                                                         finish_reason=finish)]
    return ChatCompletionChunk(id="c", created=0, model=MODEL, choices=choices, usage=usage)


def _call(index: int, name: str | None, arguments: str, call_id: str | None = None
          ) -> DeltaMessage:
    return DeltaMessage(tool_calls=[DeltaToolCall(
        index=index, id=call_id, type="function" if name else None,
        function=DeltaFunctionCall(name=name, arguments=arguments))])


def test_events_of_reasoning_text_and_two_calls() -> None:
    skeleton = {"id": "resp_x", "object": "response", "created_at": 0, "status": "in_progress",
                "model": MODEL, "output": [], "tools": [], "tool_choice": "auto",
                "parallel_tool_calls": True}
    b = ResponseEvents(skeleton)
    events = b.start()
    for chunk in [_chunk(DeltaMessage(role="assistant", content="")),
                  _chunk(DeltaMessage(reasoning_content="Think")),
                  _chunk(DeltaMessage(reasoning_content="ing.")),
                  _chunk(DeltaMessage(content="Calling.")),
                  _chunk(_call(0, "a", '{"x": ', "call_a")), _chunk(_call(0, None, "1}")),
                  _chunk(_call(1, "b", "{}", "call_b")),
                  _chunk(DeltaMessage(), finish="tool_calls"),
                  _chunk(usage=UsageInfo(prompt_tokens=5, completion_tokens=7,
                                         total_tokens=12))]:
        events += b.feed(chunk)
    response, last = b.finish()
    events += last
    types = [e["type"] for e in events]
    assert types == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added",
        "response.reasoning_text.delta", "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["output_index"] for e in events if e["type"] == "response.output_item.added"] == [
        0, 1, 2, 3]
    parsed = SDKResponse.model_validate(response)
    assert parsed.output_text == "Calling." and parsed.status == "completed"
    reasoning, message, a, b_call = parsed.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == "Thinking."
    assert message.type == "message" and message.status == "completed"
    assert (a.call_id, a.name, a.arguments) == ("call_a", "a", '{"x": 1}')
    assert (b_call.call_id, b_call.arguments) == ("call_b", "{}")
    assert parsed.usage is not None and parsed.usage.total_tokens == 12


def test_events_of_an_empty_length_cut_output() -> None:
    b = ResponseEvents({"id": "resp_y", "status": "in_progress", "model": MODEL})
    b.start()
    b.feed(_chunk(DeltaMessage(), finish="length"))
    response, last = b.finish()
    assert last[-1]["type"] == "response.incomplete"
    assert response["incomplete_details"] == {"reason": "max_output_tokens"}
    assert response["output"][0]["status"] == "incomplete"
    assert SDKResponse.model_validate(response).output_text == ""


def test_whole_message_with_reasoning_and_a_call() -> None:
    message = ChatResponseMessage(content="", reasoning_content="Hmm.", tool_calls=[
        ToolCallOut(id="call_1", function=FunctionCallOut(name="f", arguments="{}"))])
    response = ResponseEvents({"id": "resp_z", "status": "in_progress", "model": MODEL}).whole(
        message, "tool_calls", UsageInfo(prompt_tokens=3, completion_tokens=4, total_tokens=7))
    parsed = SDKResponse.model_validate(response)
    assert [o.type for o in parsed.output] == ["reasoning", "function_call"]
    assert parsed.output[1].call_id == "call_1" and parsed.status == "completed"
    assert parsed.usage is not None and parsed.usage.output_tokens == 4


def test_a_failed_stream_ends_with_response_failed() -> None:
    b = ResponseEvents({"id": "resp_f", "status": "in_progress", "model": MODEL})
    events = b.start() + b.feed(_chunk(DeltaMessage(content="Half")))
    events += b.fail("the model step failed")
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[-2]["type"] == "response.output_item.done"
    assert events[-2]["item"]["status"] == "incomplete"
    event = events[-1]
    assert event["type"] == "response.failed"
    failed = SDKResponse.model_validate(event["response"])
    assert failed.status == "failed" and failed.error is not None
    assert failed.error.message == "the model step failed" and failed.output_text == "Half"


def test_store_is_a_bounded_lru() -> None:
    store = ResponseStore(2)
    for name in ("a", "b"):
        store.put(name, StoredResponse({"id": name}))
    assert store.get("a") is not None  # "a" is now the most recently used
    store.put("c", StoredResponse({"id": "c"}))
    assert "b" not in store and "a" in store and "c" in store and len(store) == 2
    assert store.delete("a") and not store.delete("a")
    with pytest.raises(ValueError):
        ResponseStore(0)


def test_every_kv_block_is_back(server: RunningServer, client: openai.OpenAI) -> None:
    create(client, input="One more.", max_output_tokens=4)
    assert server.wait_idle()["octavo:kv_blocks_used"] == 0
