"""A request shaped as Claude Code sends it to /v1/messages: system prompt blocks and system
messages inside `messages` (not Anthropic's API, but what Claude Code writes: they are hoisted
into the system prompt), many tools with JSON-schema extras, `cache_control` everywhere,
metadata, a thinking budget, an earlier tool round trip, streamed. The tiny random-weight
model answers; only the protocol is judged."""

from __future__ import annotations

import json
from collections.abc import Iterator

import anthropic
import httpx
import pytest

from tests.conftest import build_tiny_llama
from tests.server.conftest import RunningServer, start_server, stop_server

EPHEMERAL = {"type": "ephemeral"}


def tool(i: int) -> dict:
    return {"name": f"Tool{i}", "description": f"Does thing {i}. " * 3,
            "input_schema": {"$schema": "http://json-schema.org/draft-07/schema#",
                             "type": "object", "additionalProperties": False,
                             "properties": {"path": {"type": "string", "description": "a file"},
                                            "limit": {"type": "number"}},
                             "required": ["path"]}}


TOOLS = [tool(i) for i in range(12)]
TOOLS[-1]["cache_control"] = EPHEMERAL
CLAUDE_CODE = {
    "model": "tiny", "max_tokens": 16, "stream": True, "temperature": 1,
    "metadata": {"user_id": "user_abc_account__session_123"},
    "thinking": {"type": "enabled", "budget_tokens": 1024},
    "system": [{"type": "text", "text": "You are Claude Code.", "cache_control": EPHEMERAL},
               {"type": "text", "text": "Be brief.", "cache_control": EPHEMERAL}],
    "tools": TOOLS,
    "messages": [
        {"role": "system", "content": "Mid-conversation system note."},
        {"role": "user", "content": [
            {"type": "text", "text": "<system-reminder>ctx</system-reminder>"},
            {"type": "text", "text": "read a.txt", "cache_control": EPHEMERAL}]},
        {"role": "assistant", "content": [
            {"type": "text", "text": "Reading it."},
            {"type": "tool_use", "id": "toolu_01", "name": "Tool0",
             "input": {"path": "a.txt"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_01", "cache_control": EPHEMERAL,
             "content": [{"type": "text", "text": "hello"}]}]},
        {"role": "system", "content": [{"type": "text", "text": "Another note.",
                                        "cache_control": EPHEMERAL}]},
    ],
}


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[RunningServer]:
    model = build_tiny_llama(tmp_path_factory.mktemp("tiny-8k"), max_position_embeddings=8192)
    s = start_server(model, num_kv_blocks=1024, enable_auto_tool_choice=True,
                     tool_call_parser="hermes", reasoning_parser="qwen3")
    yield s
    stop_server(s)


def test_claude_code_shaped_request_streams(server: RunningServer) -> None:
    events = []
    with httpx.stream("POST", f"{server.url}/v1/messages", json=CLAUDE_CODE, timeout=120,
                      headers={"x-api-key": "unused", "anthropic-version": "2023-06-01",
                               "anthropic-beta": "prompt-caching-2024-07-31"}) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
    kinds = [e["type"] for e in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert "error" not in kinds and events[-2]["delta"]["stop_reason"] == "max_tokens"
    assert events[0]["message"]["usage"]["input_tokens"] > 1000  # the tools are in the prompt


def test_system_messages_are_hoisted_into_the_system_prompt(server: RunningServer) -> None:
    client = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    inline = [{"role": "system", "content": "Rule one."}, {"role": "user", "content": "hi"},
              {"role": "system", "content": [{"type": "text", "text": "Rule two."}]}]
    hoisted = client.messages.count_tokens(
        model="tiny", system="Base.\n\nRule one.\n\nRule two.",
        messages=[{"role": "user", "content": "hi"}]).input_tokens
    assert client.messages.count_tokens(model="tiny", system="Base.",
                                        messages=inline).input_tokens == hoisted
    r = client.messages.create(model="tiny", max_tokens=2, system="Base.", messages=inline)
    assert r.usage.input_tokens == hoisted and r.stop_reason == "max_tokens"
    with pytest.raises(anthropic.BadRequestError, match="user or assistant message"):
        client.messages.create(model="tiny", max_tokens=2, messages=[
            {"role": "system", "content": ""}])
    with pytest.raises(anthropic.BadRequestError, match="text blocks only"):
        client.messages.create(model="tiny", max_tokens=2, messages=[
            {"role": "system", "content": [{"type": "tool_result", "tool_use_id": "x"}]},
            {"role": "user", "content": "hi"}])
