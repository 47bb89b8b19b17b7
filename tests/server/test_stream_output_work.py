"""A stream's per-step output work does not grow with its length: the server asks the engine
for DELTA outputs, so each step copies only the tokens it added (counted, not timed)."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.conftest import build_tiny_llama
from tests.server.conftest import start_server, stop_server

STREAM_TOKENS = 2000


@pytest.fixture(scope="module")
def long_server(tmp_path_factory):
    model = build_tiny_llama(tmp_path_factory.mktemp("long") / "m", max_position_embeddings=4096)
    s = start_server(model, num_kv_blocks=512, block_size=16, max_model_len=4096)
    yield s
    stop_server(s)


def test_a_long_stream_copies_each_token_once(long_server, monkeypatch):
    processor = long_server.engine.engine.output_processor
    per_step: list[int] = []
    real = processor.make_outputs

    def counting(updates):
        before = processor.tokens_copied
        outputs = real(updates)
        per_step.append(processor.tokens_copied - before)
        return outputs

    monkeypatch.setattr(processor, "make_outputs", counting)
    body = {"model": long_server.model, "prompt": "hello", "max_tokens": STREAM_TOKENS,
            "ignore_eos": True, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    received = 0
    usage = None
    with httpx.stream("POST", f"{long_server.v1}/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            received += len(chunk["choices"])
            usage = chunk.get("usage") or usage
    assert usage is not None and usage["completion_tokens"] == STREAM_TOKENS
    assert received >= 1
    # every step carried the one token it sampled: STREAM_TOKENS in all, never more than one
    # per step, however long the stream already was
    assert sum(per_step) == STREAM_TOKENS
    assert max(per_step) == 1
