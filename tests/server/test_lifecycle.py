"""Cancellation, 200 concurrent streams, vLLM's benchmark contract, metrics, SIGTERM."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.server.conftest import RunningServer

LONG = {"prompt": "tell me a long story", "max_tokens": 480, "n": 4, "ignore_eos": True,
        "temperature": 1.0}


def test_disconnect_mid_stream_frees_everything(tiny_server: RunningServer,
                                                monkeypatch) -> None:
    before = tiny_server.wait_idle()
    tiny_server.slow_steps(monkeypatch, 0.005)  # else it can end before the metrics are read
    with httpx.stream("POST", f"{tiny_server.url}/v1/completions", json={**LONG, "stream": True},
                      timeout=30) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        got = [line for line, _ in zip(lines, range(6), strict=False) if line.startswith("data:")]
        assert got
        m = tiny_server.metrics()
        assert m["vllm:num_requests_running"] == 1 and m["octavo:kv_blocks_used"] > 0
    # the response is closed mid-stream: the request is aborted, its blocks are free
    after = tiny_server.wait_idle(timeout=5)
    assert after["vllm:num_requests_running"] == 0
    assert after["octavo:kv_blocks_used"] == 0
    generated = after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"]
    assert generated < LONG["n"] * LONG["max_tokens"]  # aborted, not run to the end


def test_disconnect_while_waiting_non_streaming(tiny_server: RunningServer, monkeypatch) -> None:
    before = tiny_server.wait_idle()
    # The tiny model can finish 4 x 480 tokens within the client's timeout on a quiet
    # machine; slowing each engine step keeps the request in flight when the client leaves.
    tiny_server.slow_steps(monkeypatch, 0.01)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{tiny_server.url}/v1/completions", json=LONG, timeout=0.5)
    after = tiny_server.wait_idle(timeout=5)
    assert after["octavo:kv_blocks_used"] == 0 and after["vllm:num_requests_running"] == 0
    generated = after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"]
    assert 0 < generated < LONG["n"] * LONG["max_tokens"]
    assert (after.get("vllm:request_success_total", 0)
            == before.get("vllm:request_success_total", 0))


async def _stream_one(client: httpx.AsyncClient, i: int, max_tokens: int) -> tuple[int, int, str]:
    body = {"prompt": f"request {i}", "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 1.0, "stream": True, "stream_options": {"include_usage": True}}
    n_text_chunks, usage, finish = 0, -1, ""
    async with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk["choices"]:
                n_text_chunks += 1
                finish = chunk["choices"][0]["finish_reason"] or finish
            if chunk.get("usage"):
                usage = chunk["usage"]["completion_tokens"]
    return usage, n_text_chunks, finish


def test_200_concurrent_streams(tiny_server: RunningServer) -> None:
    lengths = [4 + i % 29 for i in range(200)]

    async def main():
        limits = httpx.Limits(max_connections=250, max_keepalive_connections=250)
        async with httpx.AsyncClient(base_url=tiny_server.url, limits=limits,
                                     timeout=120) as client:
            return await asyncio.gather(*(
                _stream_one(client, i, n) for i, n in enumerate(lengths)
            ))

    results = asyncio.run(main())
    assert [u for u, _, _ in results] == lengths
    assert all(f == "length" and chunks >= 1 for _, chunks, f in results)
    m = tiny_server.wait_idle()
    assert m["octavo:kv_blocks_used"] == 0 and m["vllm:num_requests_running"] == 0


def test_vllm_benchmark_contract(tiny_server: RunningServer) -> None:
    """What vLLM's benchmark_serving reads: /v1/models root, last chunk usage, exact lengths."""
    card = httpx.get(f"{tiny_server.v1}/models").json()["data"][0]
    assert card["root"] and card["id"] == "tiny"
    payload = {"model": card["id"], "prompt": [5, 6, 7, 8], "temperature": 0.0,
               "max_tokens": 37, "logprobs": None, "stream": True,
               "stream_options": {"include_usage": True}, "ignore_eos": True}
    with httpx.stream("POST", f"{tiny_server.v1}/completions", json=payload, timeout=60) as r:
        data = [line.removeprefix("data: ") for line in r.iter_lines() if line]
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    assert chunks[-1]["usage"]["completion_tokens"] == 37
    assert chunks[-1]["usage"]["prompt_tokens"] == 4
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    full = httpx.post(f"{tiny_server.v1}/completions",
                      json={**payload, "stream": False}, timeout=60).json()
    assert full["choices"][0]["text"] == text and full["usage"]["completion_tokens"] == 37


def test_metric_names(tiny_server: RunningServer) -> None:
    httpx.post(f"{tiny_server.v1}/completions", json={"prompt": "m", "max_tokens": 3})
    m = tiny_server.metrics()
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                 "prefix_cache_queries_total", "prefix_cache_hits_total",
                 "num_preemptions_total", "prompt_tokens_total", "generation_tokens_total",
                 "time_to_first_token_seconds_count", "inter_token_latency_seconds_count",
                 "e2e_request_latency_seconds_count", "request_queue_time_seconds_count"):
        assert f"vllm:{name}" in m, name
    for name in ("kv_blocks_used", "kv_blocks_cached_free", "kv_blocks_total",
                 "kv_slots_internal_waste", "kv_slots_reserved_waste",
                 "kv_slots_external_waste", "num_requests_swapped", "kv_sliding_blocks_held_max",
                 "kv_slots_out_of_window", "kv_blocks_freed_out_of_window_total",
                 "kv_cache_bytes_per_token"):
        assert f"octavo:{name}" in m, name
    assert 'cache_dtype="float32"' in httpx.get(f"{tiny_server.url}/metrics").text
    assert m["octavo:kv_cache_bytes_per_token"] == 2 * 2 * 2 * 16 * 4  # the tiny model, fp32
    assert m["octavo:kv_blocks_total"] == 2048
    assert m["vllm:e2e_request_latency_seconds_count"] >= 1
    assert m["vllm:generation_tokens_total"] >= 3


def start_serve_process(model_dir: Path, *flags: str) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "octavo.cli", "serve", "--model", str(model_dir),
         "--port", "0", "--num-kv-blocks", "512", "--uvicorn-log-level", "info", *flags],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
    )
    assert proc.stdout is not None
    for line in proc.stdout:  # uvicorn prints the port it bound
        if "Uvicorn running on" in line:
            return proc, line.split("running on ")[1].split()[0]
    proc.kill()
    raise AssertionError("the server did not start")


def stream_lines(url: str, body: dict, into: list[str]) -> None:
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True},
                      timeout=60) as r:
        into.extend(r.iter_lines())


def test_sigterm_drains_in_flight_streams_then_exits_0(tiny_llama_dir: Path) -> None:
    """SIGTERM: new requests and /health get 503 at once, the streams in flight run to
    their end, then the process exits 0."""
    proc, url = start_serve_process(tiny_llama_dir, "--shutdown-timeout", "60")
    try:
        body = {"prompt": "story", "max_tokens": 400, "ignore_eos": True, "temperature": 1.0}
        results: list[list[str]] = [[] for _ in range(8)]
        threads = [threading.Thread(target=stream_lines, args=(url, body, r)) for r in results]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 20
        while not all(results) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert all(results), "every stream started before the signal"
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        assert proc.poll() is None, "it drains instead of exiting at once"
        health = httpx.get(f"{url}/health", timeout=5)
        refused = httpx.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 1},
                             timeout=5)
        assert health.status_code == 503 and refused.status_code == 503
        assert "shutting down" in refused.json()["error"]["message"]
        assert proc.wait(timeout=60) == 0
        for t in threads:
            t.join(timeout=10)
        for lines in results:
            data = [x for x in lines if x.startswith("data: ")]
            assert data[-1] == "data: [DONE]"
            last = json.loads(data[-2][6:])
            assert last["choices"][0]["finish_reason"] == "length"  # ran to the end
            texts = [json.loads(d[6:]) for d in data[:-1]]
            assert sum(1 for c in texts if c["choices"] and c["choices"][0]["text"]) >= 1
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_sigterm_aborts_what_outlives_the_shutdown_timeout(tiny_llama_dir: Path) -> None:
    # the timeout must be short against the request: on an idle machine the tiny model
    # generates LONG (480 steps) in well under a second, and a 0.5 s timeout let it finish
    proc, url = start_serve_process(tiny_llama_dir, "--shutdown-timeout", "0.05")
    try:
        lines: list[str] = []
        t = threading.Thread(target=stream_lines, args=(url, LONG, lines))
        t.start()
        deadline = time.monotonic() + 10
        while not lines and time.monotonic() < deadline:
            time.sleep(0.02)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        t.join(timeout=10)
        data = [x for x in lines if x.startswith("data: ")]
        assert data[-1] == "data: [DONE]"
        assert "shutting down" in data[-2]  # aborted, not run to the end
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
