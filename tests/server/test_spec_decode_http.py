"""`octavo serve --speculative-config`: completions speculate, and /metrics shows vLLM's
spec_decode_* counters."""

from __future__ import annotations

import re

import httpx

from tests.server.conftest import start_server, stop_server

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
        "prompt_lookup_max": 2, "cost_model": False}


def metric(text: str, name: str, labels: str = "") -> float:
    m = re.search(rf"^vllm:{name}(?:_total)?{{[^}}]*{labels}[^}}]*}} ([0-9.e+]+)$", text,
                  re.MULTILINE)
    assert m, f"no {name}{labels} in /metrics"
    return float(m.group(1))


def test_speculative_server_reports_spec_decode_metrics(tiny_llama_dir):
    s = start_server(tiny_llama_dir, speculative_config=SPEC, block_size=8)
    try:
        body = {"model": s.model, "prompt": "abcabcabcabcabc", "max_tokens": 24,
                "temperature": 0, "ignore_eos": True}
        plain = httpx.post(f"{s.v1}/completions", json=body, timeout=60).json()
        assert plain["usage"]["completion_tokens"] == 24
        text = httpx.get(f"{s.url}/metrics", timeout=10).text
        drafts = metric(text, "spec_decode_num_drafts")
        tokens = metric(text, "spec_decode_num_draft_tokens")
        accepted = metric(text, "spec_decode_num_accepted_tokens")
        assert drafts > 0 and tokens >= drafts and 0 <= accepted <= tokens
        by_pos = [metric(text, "spec_decode_num_accepted_tokens_per_pos", f'position="{p}"')
                  for p in range(3)]
        assert sum(by_pos) == accepted
        assert by_pos == sorted(by_pos, reverse=True)  # a later position needs the earlier
    finally:
        stop_server(s)
    assert s.engine.engine.stats()["kv_blocks_used"] == 0
