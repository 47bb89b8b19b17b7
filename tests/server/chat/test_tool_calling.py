"""Tool calling over HTTP, with the official `openai` client against a real server.

Forced calls (tool_choice "required" or a named function) are constrained by the tools'
schemas, so at temperature 1 every call still parses and validates; streamed calls add up to
the same. An agent loop sends the calls and their results back; "auto" with the hermes parser
may or may not call, but must say consistently which it did; malformed tool requests are
400s in OpenAI's shape.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jsonschema
import openai
import pytest

from tests.server.conftest import RunningServer, start_server, stop_server

MODEL = "smollm2"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather of a city.",
    "parameters": {"type": "object",
                   "properties": {"city": {"type": "string", "maxLength": 20},
                                  "unit": {"type": "string", "enum": ["c", "f"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The current time in a timezone.",
    "parameters": {"type": "object",
                   "properties": {"timezone": {"type": "string",
                                               "pattern": "^[A-Z][a-z]+/[A-Z][a-z]+$"}},
                   "required": ["timezone"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris, and the time in Tokyo?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def server(default_model_dir) -> Iterator[RunningServer]:
    s = start_server(default_model_dir, name=MODEL, num_kv_blocks=512, max_model_len=2048,
                     enable_auto_tool_choice=True, tool_call_parser="hermes")
    yield s
    stop_server(s)


@pytest.fixture(scope="module")
def client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0, timeout=120)


def chat(client: openai.OpenAI, messages: list[dict[str, Any]] = ASK, **kw: Any):
    kw = {"tools": TOOLS, "max_tokens": 120, "temperature": 0, **kw}
    return client.chat.completions.create(model=MODEL, messages=messages, **kw)


def check_call(name: str, arguments: str) -> dict[str, Any]:
    """A call names a tool and its arguments are a JSON object valid for that tool."""
    assert name in PARAMETERS, name
    args = json.loads(arguments)
    jsonschema.validate(args, PARAMETERS[name])
    return args


def tool_result(name: str, args: dict[str, Any]) -> dict[str, Any]:
    if name == "get_weather":
        return {"city": args["city"], "temperature": 21, "unit": args["unit"], "sky": "sunny"}
    return {"timezone": args["timezone"], "time": "14:05"}


# ---- forced calls ---------------------------------------------------------------------------
@pytest.mark.parametrize("choice,parallel", [("required", True), ("required", False),
                                             ("named", True)])
def test_forced_calls_validate(client: openai.OpenAI, choice: str, parallel: bool) -> None:
    tool_choice = NAMED if choice == "named" else "required"

    def run(seed: int):
        return chat(client, tool_choice=tool_choice, parallel_tool_calls=parallel,
                    temperature=1.0, seed=seed, n=2, max_tokens=200)

    with ThreadPoolExecutor(8) as pool:
        responses = list(pool.map(run, range(4)))
    ids = []
    for r in responses:
        for c in r.choices:
            where = (c.finish_reason, c.message)
            assert c.finish_reason == ("stop" if choice == "named" else "tool_calls"), where
            assert c.message.content is None, where
            calls = c.message.tool_calls
            assert calls, where
            if choice == "named":
                assert len(calls) == 1 and calls[0].function.name == "get_weather"
            if not parallel:
                assert len(calls) == 1, where
            for call in calls:
                assert call.type == "function" and call.id
                check_call(call.function.name, call.function.arguments)
                ids.append(call.id)
    assert len(ids) == len(set(ids)), "tool call ids repeat"


def collect_stream(chunks) -> tuple[dict[int, dict[str, Any]], str | None, str]:
    """The calls of a streamed choice 0 by index, its finish reason and its text content."""
    calls: dict[int, dict[str, Any]] = {}
    finish, content = None, ""
    for ch in chunks:
        for c in ch.choices:
            assert c.index == 0
            content += c.delta.content or ""
            for d in c.delta.tool_calls or []:
                if d.index not in calls:  # the first delta of a call says what it is
                    assert d.id and d.type == "function" and d.function.name, d
                    calls[d.index] = {"id": d.id, "name": d.function.name, "arguments": ""}
                else:
                    assert d.id is None and (d.function is None or d.function.name is None), d
                calls[d.index]["arguments"] += (d.function.arguments or "") if d.function else ""
            if c.finish_reason is not None:
                assert finish is None, "two finish reasons"
                finish = c.finish_reason
    assert sorted(calls) == list(range(len(calls)))
    return calls, finish, content


@pytest.mark.parametrize("choice,parallel", [("required", True), ("required", False),
                                             ("named", True)])
def test_streamed_forced_calls(client: openai.OpenAI, choice: str, parallel: bool) -> None:
    tool_choice = NAMED if choice == "named" else "required"

    def run(seed: int):
        return collect_stream(chat(client, tool_choice=tool_choice,
                                   parallel_tool_calls=parallel, temperature=1.0, seed=seed,
                                   max_tokens=200, stream=True))

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(run, range(3)))
    ids = []
    for calls, finish, content in results:
        assert finish == ("stop" if choice == "named" else "tool_calls")
        assert content == "" and calls
        if choice == "named":
            assert [c["name"] for c in calls.values()] == ["get_weather"]
        if not parallel:
            assert len(calls) == 1
        for call in calls.values():
            check_call(call["name"], call["arguments"])
            ids.append(call["id"])
    assert len(ids) == len(set(ids))


@pytest.mark.parametrize("choice", ["required", "named"])
def test_stream_matches_whole_response(client: openai.OpenAI, choice: str) -> None:
    tool_choice = NAMED if choice == "named" else "required"
    whole = chat(client, tool_choice=tool_choice).choices[0].message.tool_calls
    calls, _, _ = collect_stream(chat(client, tool_choice=tool_choice, stream=True))
    assert [(c.function.name, c.function.arguments) for c in whole] == [
        (c["name"], c["arguments"]) for c in calls.values()]


def test_forced_call_cut_short(client: openai.OpenAI) -> None:
    """A call cut by max_tokens is no call: the partial text stays content."""
    for tool_choice in ("required", NAMED):
        c = chat(client, tool_choice=tool_choice, max_tokens=4).choices[0]
        assert c.finish_reason == "length"
        assert not c.message.tool_calls and c.message.content


# ---- the agent loop -------------------------------------------------------------------------
@pytest.mark.parametrize("first,final,form", [("required", "none", "dict"),
                                              ("named", "none", "object"),
                                              ("required", "auto", "object")])
def test_agent_loop(client: openai.OpenAI, first: str, final: str, form: str) -> None:
    """form: the assistant message goes back as the SDK's dump, or as the SDK's message object
    itself (which the SDK sends with the null fields the server set)."""
    messages: list[Any] = list(ASK)
    r = chat(client, messages, tool_choice=NAMED if first == "named" else "required")
    message = r.choices[0].message
    assert message.tool_calls
    messages.append(message.model_dump(exclude_none=True) if form == "dict" else message)
    for call in message.tool_calls:
        args = check_call(call.function.name, call.function.arguments)
        messages.append({"role": "tool", "tool_call_id": call.id,
                         "content": json.dumps(tool_result(call.function.name, args))})
    answer = chat(client, messages, tool_choice=final, max_tokens=32).choices[0]
    if final == "none":
        assert not answer.message.tool_calls
        assert answer.finish_reason in ("stop", "length")
        assert answer.message.content and answer.message.content.strip()
    else:
        assert_consistent(answer)


def test_streamed_agent_loop(client: openai.OpenAI) -> None:
    messages = list(ASK)
    calls, finish, _ = collect_stream(chat(client, messages, tool_choice=NAMED, stream=True))
    assert finish == "stop" and len(calls) == 1
    call = calls[0]
    args = check_call(call["name"], call["arguments"])
    messages.append({"role": "assistant", "content": None, "tool_calls": [
        {"id": call["id"], "type": "function",
         "function": {"name": call["name"], "arguments": call["arguments"]}}]})
    messages.append({"role": "tool", "tool_call_id": call["id"],
                     "content": json.dumps(tool_result(call["name"], args))})
    calls, finish, content = collect_stream(chat(client, messages, tool_choice="none",
                                                 max_tokens=32, stream=True))
    assert not calls and finish in ("stop", "length") and content.strip()
    # the same conversation, not streamed, answers the same text
    whole = chat(client, messages, tool_choice="none", max_tokens=32).choices[0]
    assert whole.message.content == content


# ---- tool_choice auto -----------------------------------------------------------------------
def assert_consistent(c) -> None:
    """finish_reason "tool_calls" exactly when calls came back (a length cut says "length")."""
    calls = c.message.tool_calls or []
    if c.finish_reason == "tool_calls":
        assert calls, c
    else:
        assert c.finish_reason in ("stop", "length"), c
        assert c.finish_reason == "length" or not calls, c
    for call in calls:
        assert call.function.name in PARAMETERS and call.id
        assert isinstance(json.loads(call.function.arguments), dict)
    if not calls:
        assert isinstance(c.message.content, str)


def test_auto(client: openai.OpenAI) -> None:
    with ThreadPoolExecutor(3) as pool:
        sampled = pool.submit(chat, client, tool_choice="auto", temperature=1.0, seed=7, n=3,
                              max_tokens=40)
        implicit = pool.submit(chat, client, max_tokens=40)  # tools, no tool_choice: auto
        streamed = pool.submit(lambda: collect_stream(chat(client, tool_choice="auto",
                                                           max_tokens=40, stream=True)))
        for c in sampled.result().choices + implicit.result().choices:
            assert_consistent(c)
        calls, finish, content = streamed.result()
    assert finish in ("stop", "length", "tool_calls")
    assert (finish == "tool_calls") == bool(calls) or finish == "length"
    assert calls or content


# ---- 400s -----------------------------------------------------------------------------------
def bad_request(call) -> dict[str, Any]:
    with pytest.raises(openai.BadRequestError) as info:
        call()
    e = info.value
    assert e.status_code == 400
    assert isinstance(e.body, dict) and set(e.body) >= {"message", "type", "param"}
    assert e.body["type"] == "BadRequestError" and e.body["message"]
    return e.body


CALL = {"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}}
BAD = [
    ("unknown function", dict(tool_choice={"type": "function", "function": {"name": "nope"}}),
     "'nope'", "tool_choice"),
    ("tool_choice without tools", dict(tools=None, tool_choice="required"), "needs tools",
     "tool_choice"),
    ("named choice without tools", dict(tools=None, tool_choice=NAMED), "needs tools",
     "tool_choice"),
    ("tool message answering no call",
     dict(messages=ASK + [{"role": "assistant", "tool_calls": [CALL]},
                          {"role": "tool", "tool_call_id": "call_2", "content": "{}"}]),
     "'call_2'", "messages.2.tool_call_id"),
    ("tool message before any call",
     dict(messages=ASK + [{"role": "tool", "tool_call_id": "call_1", "content": "{}"}]),
     "'call_1'", "messages.1.tool_call_id"),
    ("arguments not JSON",
     dict(messages=ASK + [{"role": "assistant", "tool_calls": [
         {**CALL, "function": {"name": "get_weather", "arguments": '{"city": '}}]}]),
     "not valid JSON", "messages.1.tool_calls"),
    ("arguments not an object",
     dict(messages=ASK + [{"role": "assistant", "tool_calls": [
         {**CALL, "function": {"name": "get_weather", "arguments": "[1]"}}]}]),
     "JSON object", "messages.1.tool_calls"),
    ("tool message without tool_call_id",
     dict(messages=ASK + [{"role": "assistant", "tool_calls": [CALL]},
                          {"role": "tool", "content": "{}"}]),
     "tool_call_id", "messages.2"),
    ("uncompilable tool parameters",
     dict(tools=[{"type": "function", "function": {"name": "f",
                                                   "parameters": {"type": "no-such-type"}}}],
          tool_choice="required"),
     "no-such-type", "tools"),
    ("duplicate tool names", dict(tools=[WEATHER, TIME, WEATHER]), "'get_weather'", "tools"),
    ("required with response_format",
     dict(tool_choice="required", response_format={"type": "json_object"}),
     "cannot be combined", "tool_choice"),
    ("named with structured_outputs",
     dict(tool_choice=NAMED, extra_body={"structured_outputs": {"regex": "a+"}}),
     "cannot be combined", "tool_choice"),
]


@pytest.mark.parametrize("label,kwargs,says,param", BAD, ids=[b[0] for b in BAD])
def test_bad_tool_request_is_400(client: openai.OpenAI, label: str, kwargs: dict, says: str,
                                 param: str) -> None:
    kwargs = {"max_tokens": 5, **kwargs}
    if kwargs.get("tools", TOOLS) is None:
        del kwargs["tools"]
        kwargs = {**kwargs, "tools": openai.NOT_GIVEN}
    body = bad_request(lambda: chat(client, **kwargs))
    assert says in body["message"], body
    assert body["param"] == param, body
    r = chat(client, tool_choice=NAMED, max_tokens=40)  # the server still serves
    assert r.choices[0].message.tool_calls


def test_auto_needs_the_server_flag(tiny_server: RunningServer) -> None:
    tiny = openai.OpenAI(base_url=tiny_server.v1, api_key="unused", max_retries=0)
    for extra in ({"tool_choice": "auto"}, {}):
        body = bad_request(lambda extra=extra: tiny.chat.completions.create(
            model="tiny", messages=ASK, tools=TOOLS, max_tokens=5, **extra))
        assert "--enable-auto-tool-choice" in body["message"], body
        assert body["param"] == "tool_choice"
    # forced calls need no parser: they work there (a small tool: the prompt must fit in 512)
    small = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "integer", "minimum": 0,
                                               "maximum": 999}},
        "required": ["x"], "additionalProperties": False}}}
    r = tiny.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                     tools=[small], tool_choice="required",
                                     parallel_tool_calls=False, max_tokens=60, temperature=0)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls", c
    (call,) = c.message.tool_calls
    assert call.function.name == "f"
    jsonschema.validate(json.loads(call.function.arguments),
                        small["function"]["parameters"])
    r = tiny.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice="none",
                                     max_tokens=5, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length")
    assert tiny_server.wait_idle()["octavo:kv_blocks_used"] == 0


def test_all_kv_blocks_back(server: RunningServer, client: openai.OpenAI) -> None:
    chat(client, tool_choice=NAMED, max_tokens=40)
    m = server.wait_idle()
    assert m["octavo:kv_blocks_used"] == 0
    assert m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0
