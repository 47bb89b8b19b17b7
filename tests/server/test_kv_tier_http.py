"""`octavo serve` with a KV tier: a restarted server answers a resent long prompt from the tier
(the same completion; the hit in /metrics), and its page map carries the tier's fields."""

from __future__ import annotations

import random

import httpx

from tests.server.conftest import start_server, stop_server


def test_a_restarted_server_serves_the_prompt_from_the_tier(tiny_llama_dir, tmp_path) -> None:
    rng = random.Random(12)
    prompt = [rng.randrange(3, 256) for _ in range(300)]
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 6, "temperature": 0}
    opts = dict(num_kv_blocks=64, block_size=16, kv_offload_dir=str(tmp_path / "tier"))

    first = start_server(tiny_llama_dir, **opts)
    try:
        cold = httpx.post(f"{first.v1}/completions", json=body, timeout=60).json()
    finally:
        stop_server(first)  # the engine's shutdown waits for the tier's writer
    assert list((tmp_path / "tier").rglob("*.kvb"))

    second = start_server(tiny_llama_dir, **opts)
    try:
        warm = httpx.post(f"{second.v1}/completions", json=body, timeout=60).json()
        metrics = second.wait_idle()
        snap = httpx.get(f"{second.url}/v1/kv_map").json()
    finally:
        stop_server(second)
    assert warm["choices"][0]["text"] == cold["choices"][0]["text"]
    assert metrics["vllm:external_prefix_cache_hits_total"] == (len(prompt) - 1) // 16 * 16
    assert metrics["octavo:kv_tier_blocks_loaded_total"] == (len(prompt) - 1) // 16
    assert snap["device"]["tier_saving"] == [] and "tier_loaded" in snap["device"]
    assert snap["stats"]["tier_hit_tokens"] > 0
