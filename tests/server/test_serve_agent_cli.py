"""`octavo serve` as a user starts it, with the agent flags (--enable-auto-tool-choice,
--tool-call-parser, --reasoning-parser, --max-stored-responses), driven by the official openai
and anthropic SDKs: chat, the Responses API and the Messages API, streamed."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import anthropic
import openai
import pytest

from octavo.bench.options import BenchOptions
from octavo.bench.server_proc import ServerProcess
from tests.conftest import build_tiny_llama

FLAGS = ["--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--reasoning-parser",
         "qwen3", "--max-stored-responses", "2", "--num-kv-blocks", "256"]
THINK = r"<think>[a-z]{5}</think>[a-z]{4}"


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[ServerProcess]:
    model = build_tiny_llama(tmp_path_factory.mktemp("tiny-serve"), max_position_embeddings=2048)
    proc = ServerProcess(BenchOptions(model=str(model)), tmp_path_factory.mktemp("log") / "s.log",
                         FLAGS, name="tiny")
    try:
        proc.wait_ready()
        yield proc
    finally:
        assert proc.stop() == 0


def test_chat_stream_splits_reasoning(server: ServerProcess) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    reasoning = content = ""
    for chunk in client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "go"}], max_tokens=60,
            stream=True, extra_body={"structured_outputs": {"regex": THINK}}):
        for c in chunk.choices:
            reasoning += c.delta.model_extra.get("reasoning_content") or ""
            content += c.delta.content or ""
    assert len(reasoning) == 5 and len(content) == 4


def test_responses_stream_and_store(server: ServerProcess) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    # a constrained answer ends (random weights rarely say EOS): response.completed
    fmt = {"format": {"type": "json_schema", "name": "pick",
                      "schema": {"enum": ["yes", "no"]}}}
    with client.responses.stream(model="tiny", input="go", max_output_tokens=8,
                                 temperature=0, text=fmt) as stream:
        deltas = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert final.output_text == deltas and final.output_text in ('"yes"', '"no"')
    assert final.usage.output_tokens > 0
    assert client.responses.retrieve(final.id).id == final.id
    for _ in range(2):  # --max-stored-responses 2: the first is evicted
        client.responses.create(model="tiny", input="again", max_output_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(final.id)


def test_messages_stream(server: ServerProcess) -> None:
    client = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    with client.messages.stream(model="tiny", max_tokens=8,
                                messages=[{"role": "user", "content": "go"}]) as stream:
        text = "".join(stream.text_stream)
        message = stream.get_final_message()
    assert message.content[0].text == text and message.usage.input_tokens > 0
    assert message.stop_reason in ("end_turn", "max_tokens")
    assert server.wait_idle()["octavo:kv_blocks_used"] == 0


def test_auto_tool_choice_needs_a_parser() -> None:
    done = subprocess.run([sys.executable, "-m", "octavo.cli", "serve",
                           "--enable-auto-tool-choice"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode != 0
    assert "--enable-auto-tool-choice needs --tool-call-parser" in done.stderr
