"""An open-loop, seeded client for any OpenAI-compatible /v1/completions server, judged by an SLO.

Sessions start at Poisson times whatever the server's state (open loop: a closed loop would
slow down with the server and hide queueing); the turns of one session follow each other, the
next sent after the previous answer and a think time. Every request streams token-id prompts
with ignore_eos, so octavo, llama-server and vLLM do exactly the same work.

Servers differ in what a streamed chunk says: octavo and vLLM can put the running output count
in every chunk (`continuous_usage_stats`), llama-server sends one chunk per token and the
totals at the end. A chunk counts as a token when its usage count grows, or, without usage,
when it carries text; the final usage corrects the total. TTFT is the first token's arrival,
ITL the gaps between token chunks, TPOT (latency - TTFT) / (output tokens - 1).

A request meets the SLO when it finished without error within the TTFT and TPOT limits;
goodput is those requests per second. A rate is sustained when every request finished and the
p90 TTFT and p90 TPOT are within the limits (the issue's definition).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import httpx

from octavo.bench.common import percentile
from octavo.bench.traffic import Traffic, Turn


@dataclass(frozen=True, slots=True)
class SLO:
    ttft_s: float = 2.0
    tpot_s: float = 0.150
    quantile: float = 90.0


@dataclass
class Timing:
    session: int
    turn: int
    prompt_tokens: int
    expected_tokens: int
    sent: float = float("nan")  # seconds after the run's start
    ttft: float = float("nan")
    latency: float = float("nan")
    output_tokens: int = 0
    cached_tokens: int | None = None  # the prompt tokens the server found in its cache
    itl: list[float] = field(default_factory=list)
    error: str | None = None

    @property
    def tpot(self) -> float:
        if self.output_tokens <= 1:
            return 0.0
        return (self.latency - self.ttft) / (self.output_tokens - 1)

    def meets(self, slo: SLO) -> bool:
        return (self.error is None and self.output_tokens == self.expected_tokens
                and self.ttft <= slo.ttft_s and self.tpot <= slo.tpot_s)


def _cached(chunk: dict) -> int | None:
    usage = chunk.get("usage") or {}
    details = usage.get("prompt_tokens_details") or {}
    if details.get("cached_tokens") is not None:
        return int(details["cached_tokens"])
    timings = chunk.get("timings") or {}  # llama-server
    return int(timings["cache_n"]) if "cache_n" in timings else None


async def _request(client: httpx.AsyncClient, url: str, body: dict, rt: Timing,
                   t0: float) -> None:
    sent = time.perf_counter()
    rt.sent = sent - t0
    last = None
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                rt.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data.strip() == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    rt.error = str(chunk["error"])[:200]
                    return
                usage = chunk.get("usage") or {}
                choices = chunk.get("choices") or []
                if usage.get("completion_tokens") is not None:
                    tokens = int(usage["completion_tokens"])
                elif choices and choices[0].get("text"):
                    tokens = rt.output_tokens + 1
                else:
                    tokens = rt.output_tokens
                cached = _cached(chunk)
                if cached is not None:
                    rt.cached_tokens = cached
                if tokens > rt.output_tokens:
                    now = time.perf_counter()
                    if last is None:
                        rt.ttft = now - sent
                    else:
                        rt.itl.append(now - last)
                    last = now
                    rt.output_tokens = tokens
        rt.latency = time.perf_counter() - sent
        if rt.output_tokens != rt.expected_tokens:
            rt.error = f"{rt.output_tokens} tokens, expected {rt.expected_tokens}"
    except (TimeoutError, httpx.HTTPError, json.JSONDecodeError) as e:
        rt.error = f"{type(e).__name__}: {e}"[:200]


async def _session(client: httpx.AsyncClient, url: str, model: str, turns: tuple[Turn, ...],
                   timings: list[Timing], start: float, t0: float) -> None:
    await asyncio.sleep(max(0.0, t0 + start - time.perf_counter()))
    for k, (turn, rt) in enumerate(zip(turns, timings, strict=True)):
        if turn.think_s:
            await asyncio.sleep(turn.think_s)
        body = {
            "model": model, "prompt": list(turn.prompt_token_ids), "max_tokens": turn.output_len,
            "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        }
        await _request(client, url, body, rt, t0)
        if rt.error is not None:
            for rest in timings[k + 1:]:
                rest.error = "not sent: an earlier turn of its session failed"
            return


async def _run(base_url: str, model: str, traffic: Traffic, rate: float, seed: int,
               timeout_s: float) -> tuple[list[Timing], float]:
    starts = traffic.session_starts(rate, seed)
    per_session = [[Timing(i, k, t.prompt_len, t.output_len) for k, t in enumerate(s)]
                   for i, s in enumerate(traffic.sessions)]
    limits = httpx.Limits(max_connections=len(traffic.sessions) + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), limits=limits) as client:
        t0 = time.perf_counter()
        tasks = [asyncio.create_task(
            _session(client, f"{base_url}/v1/completions", model, s, ts, start, t0))
            for s, ts, start in zip(traffic.sessions, per_session, starts, strict=True)]
        _, pending = await asyncio.wait(tasks, timeout=timeout_s)
        for task in pending:
            task.cancel()
        duration = time.perf_counter() - t0
    timings = [t for ts in per_session for t in ts]
    for t in timings:
        if t.error is None and t.latency != t.latency:  # never finished
            t.error = f"no answer within the run's {timeout_s:.0f} s"
    return timings, duration


def run_traffic(base_url: str, model: str, traffic: Traffic, rate: float, *, seed: int = 0,
                timeout_s: float = 600) -> tuple[list[Timing], float]:
    """Drive `traffic` at `rate` requests/s; every request's timing and the run's wall time."""
    return asyncio.run(_run(base_url, model, traffic, rate, seed, timeout_s))


def peak_overlap(intervals: list[tuple[float, float]]) -> int:
    """The most intervals open at one moment (an end before a start at the same time)."""
    events = sorted([(a, 1) for a, _ in intervals] + [(b, -1) for _, b in intervals],
                    key=lambda e: (e[0], e[1]))
    peak = cur = 0
    for _, d in events:
        cur += d
        peak = max(peak, cur)
    return peak


def summarize(timings: list[Timing], duration: float, rate: float, slo: SLO) -> dict:
    """Goodput, throughput, latency percentiles and concurrency of one run."""
    ok = [t for t in timings if t.error is None]
    ms, q = 1e3, slo.quantile

    def p(xs: list[float], pct: float) -> float:
        return ms * percentile(xs, pct)

    ttft = [t.ttft for t in ok]
    tpot = [t.tpot for t in ok if t.output_tokens > 1]
    itl = [x for t in ok for x in t.itl]
    good = sum(t.meets(slo) for t in timings)
    with_cache = [t for t in ok if t.cached_tokens is not None]
    ttft_q, tpot_q = percentile(ttft, q), percentile(tpot, q) if tpot else 0.0
    sustained = (len(ok) == len(timings) and ttft_q <= slo.ttft_s and tpot_q <= slo.tpot_s)
    return {
        "rate": rate, "requests": len(timings), "completed": len(ok),
        "errors": sorted({t.error for t in timings if t.error})[:3],
        "duration_s": duration,
        "goodput_req_s": good / duration, "good_requests": good,
        "req_s": len(ok) / duration,
        "output_tok_s": sum(t.output_tokens for t in ok) / duration,
        "sustained": sustained,
        **{f"ttft_ms_p{x}": p(ttft, x) for x in (50, 90, 99)},
        **{f"tpot_ms_p{x}": p(tpot, x) for x in (50, 90, 99)},
        **{f"itl_ms_p{x}": p(itl, x) for x in (50, 90, 99)},
        # streams producing tokens at once (first token to last), as the client sees them
        "peak_running": peak_overlap([(t.sent + t.ttft, t.sent + t.latency) for t in ok]),
        "peak_in_flight": peak_overlap([(t.sent, t.sent + t.latency) for t in ok]),
        "prefix_hit_rate": (sum(t.cached_tokens or 0 for t in with_cache)
                            / max(sum(t.prompt_tokens for t in with_cache), 1)
                            if with_cache else None),
    }


def max_sustained_rate(rows: list[dict], slo: SLO | None = None) -> float:
    """The highest offered rate that was sustained (0.0 when none was): under the run's own
    SLO, or, given `slo`, judged again from the rows' percentiles under that one."""
    return max((r["rate"] for r in rows
                if (r["sustained"] if slo is None else sustained_under(r, slo))), default=0.0)


def sustained_under(row: dict, slo: SLO) -> bool:
    """summarize's `sustained` for another SLO at the same quantile, from a row's numbers."""
    q = f"p{slo.quantile:.0f}"
    return (row["completed"] == row["requests"] and row[f"ttft_ms_{q}"] <= slo.ttft_s * 1e3
            and row[f"tpot_ms_{q}"] <= slo.tpot_s * 1e3)
