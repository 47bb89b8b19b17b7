"""An open-loop load generator for an OpenAI-compatible /v1/completions endpoint.

Requests leave at Poisson arrival times (seeded), whatever the server's state: a closed loop
would slow down with the server and hide queueing. Each request streams with ignore_eos and
continuous usage stats, so every chunk says how many tokens have been generated: TTFT is the
first chunk carrying a token, ITL the gaps between token-carrying chunks, TPOT the mean time per
output token after the first, and normalized latency end-to-end latency / output tokens (the
vLLM paper's serving metric).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import httpx

from octavo.bench.common import median, percentile
from octavo.bench.workloads import Workload, poisson_arrivals


@dataclass
class RequestTiming:
    sent: float
    ttft: float = float("nan")
    latency: float = float("nan")
    output_tokens: int = 0
    itl: list[float] = field(default_factory=list)
    error: str | None = None


async def _one(client: httpx.AsyncClient, url: str, body: dict, delay: float,
               t0: float) -> RequestTiming:
    await asyncio.sleep(max(0.0, t0 + delay - time.perf_counter()))
    sent = time.perf_counter()
    rt = RequestTiming(sent)
    last = None
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                rt.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return rt
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    rt.error = str(chunk["error"])[:200]
                    break
                tokens = (chunk.get("usage") or {}).get("completion_tokens", rt.output_tokens)
                if tokens > rt.output_tokens:
                    now = time.perf_counter()
                    if last is None:
                        rt.ttft = now - sent
                    else:
                        rt.itl.append(now - last)
                    last = now
                    rt.output_tokens = tokens
        rt.latency = time.perf_counter() - sent
    except (TimeoutError, httpx.HTTPError) as e:
        rt.error = f"{type(e).__name__}: {e}"
    return rt


async def _run(base_url: str, model: str, wl: Workload, rate: float, seed: int,
               timeout_s: float) -> tuple[list[RequestTiming], float]:
    arrivals = poisson_arrivals(len(wl), rate, seed)
    limits = httpx.Limits(max_connections=len(wl) + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), limits=limits) as client:
        t0 = time.perf_counter()
        tasks = [
            _one(client, f"{base_url}/v1/completions", {
                "model": model, "prompt": list(r.prompt_token_ids), "max_tokens": r.output_len,
                "temperature": 0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            }, delay, t0)
            for r, delay in zip(wl.requests, arrivals, strict=True)
        ]
        done = await asyncio.wait_for(asyncio.gather(*tasks), timeout_s)
        return list(done), time.perf_counter() - t0


def run_load(base_url: str, model: str, wl: Workload, rate: float, *, seed: int = 0,
             timeout_s: float = 600) -> dict:
    timings, duration = asyncio.run(_run(base_url, model, wl, rate, seed, timeout_s))
    ok = [t for t in timings if t.error is None]
    expected = {id(t): r.output_len for t, r in zip(timings, wl.requests, strict=True)}
    short = sum(t.output_tokens != expected[id(t)] for t in ok)
    itl = [x for t in ok for x in t.itl]
    tpot = [(t.latency - t.ttft) / (t.output_tokens - 1) for t in ok if t.output_tokens > 1]
    norm = [t.latency / t.output_tokens for t in ok if t.output_tokens]
    ms = 1e3

    def p(xs: list[float], q: float) -> float:
        return ms * percentile(xs, q)

    return {
        "rate": rate, "requests": len(wl), "completed": len(ok), "short_outputs": short,
        "errors": [t.error for t in timings if t.error][:3],
        "duration_s": duration,
        "req_s": len(ok) / duration, "output_tok_s": sum(t.output_tokens for t in ok) / duration,
        "ttft_ms_p50": p([t.ttft for t in ok], 50), "ttft_ms_p99": p([t.ttft for t in ok], 99),
        "tpot_ms_p50": p(tpot, 50), "tpot_ms_p99": p(tpot, 99),
        "itl_ms_p50": p(itl, 50), "itl_ms_p99": p(itl, 99),
        "norm_latency_s_per_tok_mean": sum(norm) / max(len(norm), 1),
        "norm_latency_s_per_tok_p50": median(norm),
        "latency_s_p50": median([t.latency for t in ok]),
    }
