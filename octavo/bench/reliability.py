"""`octavo bench reliability`: the server under attack and under careless clients.

Each scenario runs against a real `octavo serve` subprocess and ends by checking the KV pool
(no block in use once the server is idle). `--quick` runs small versions (the test suite runs
them on the tiny model); the full run writes the figures RELIABILITY.md quotes:

- concurrency: ramps of concurrent streams; every one must end whole (usage = max_tokens).
- disconnects: 40% of the clients hang up after their first chunk; the rest end whole.
- preemption: a KV cache that fits a few requests at once; greedy outputs under that storm
  equal the same requests run one at a time.
- slow clients: streams read slowly beside a normal one; its inter-token latency holds.
- idle flood: thousands of connections that never send a request; /health answers within 1 s
  throughout, the server's log stays short, and past the header timeout none is left open.
- huge and malformed inputs: a 6 MB prompt (1 MB in the quick run) is refused while a stream
  runs (its inter-token latency grows < 2x), and a catalogue of bad bodies gets 4xx, never 5xx.
- drain: SIGTERM with 50 streams in flight and --shutdown-timeout 60; all end whole, exit 0.
- soak: many requests in a row; the server's memory stays flat.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import signal
import socket
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
from matplotlib.figure import Figure

from octavo.bench.common import BenchResult, PlotFn, md_table
from octavo.bench.options import BenchOptions
from octavo.bench.server_proc import ServerProcess
from octavo.server.connections import raise_fd_limit

MAX_MODEL_LEN = 512
HEADER_TIMEOUT_S = 5.0


def vocab_of(opts: BenchOptions) -> int:
    return 256 if opts.model else 49152  # the tiny test model / SmolLM2


# ---- clients ----------------------------------------------------------------------------------
async def stream(client: httpx.AsyncClient, body: dict, *, hang_up_after: int | None = None,
                 read_delay: float = 0.0, out: dict[str, Any] | None = None) -> dict[str, Any]:
    """One streamed completion: its status, token count (usage), finish reason, the arrival
    times of its token-carrying chunks, or its error (filled into `out` as it goes)."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True,
                                                        "continuous_usage_stats": True}}
    out = out if out is not None else {}
    out.update({"status": None, "tokens": 0, "finish": None, "times": [], "error": None,
                "text": ""})
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            out["status"] = r.status_code
            if r.status_code != 200:
                out["error"] = (await r.aread()).decode(errors="replace")[:200]
                return out
            seen = 0
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    out["error"] = chunk["error"]["message"]
                    return out
                if chunk.get("usage"):
                    out["tokens"] = chunk["usage"]["completion_tokens"]
                if chunk["choices"]:
                    out["text"] += chunk["choices"][0]["text"]
                    out["finish"] = chunk["choices"][0]["finish_reason"] or out["finish"]
                if out["tokens"] > seen:
                    seen = out["tokens"]
                    out["times"].append(time.perf_counter())
                if hang_up_after is not None and len(out["times"]) >= hang_up_after:
                    return out  # leaving the block closes the connection mid-stream
                if read_delay:
                    await asyncio.sleep(read_delay)
    except httpx.HTTPError as e:
        out["error"] = f"{type(e).__name__}: {e}"
    return out


def gaps(times: list[float]) -> list[float]:
    return [b - a for a, b in zip(times, times[1:], strict=False)]


def client(server: ServerProcess, connections: int = 1100, timeout: float = 300) -> Any:
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    return httpx.AsyncClient(base_url=server.url, limits=limits, timeout=timeout)


def body(i: int, max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {"prompt": f"request {i}: tell me something", "max_tokens": max_tokens,
            "ignore_eos": True, "temperature": 1.0, **extra}


def pool_after(server: ServerProcess) -> dict[str, float]:
    m = server.wait_idle()
    return {"kv_blocks_used_after": m.get("octavo:kv_blocks_used", -1),
            "running_after": m.get("vllm:num_requests_running", -1)}


def pool_ok(r: dict[str, Any]) -> bool:
    return r["kv_blocks_used_after"] == 0 and r["running_after"] == 0


def judge(row: dict[str, Any], checks: bool, timing: bool = True) -> None:
    """`checks`: what must hold on any machine (errors, the KV pool, statuses, outputs);
    `timing`: the latency and memory figures, judged on the full run's machine (the quick run
    in the test suite shares a small, busy machine and asserts only `checks`)."""
    row["checks_ok"] = bool(checks)
    row["timing_ok"] = bool(timing)
    row["ok"] = row["checks_ok"] and row["timing_ok"]


# ---- scenarios --------------------------------------------------------------------------------
def concurrency(server: ServerProcess, opts: BenchOptions) -> list[dict[str, Any]]:
    rows = []
    for n in ([50] if opts.quick else [100, 500, 1000]):
        max_tokens = opts.pick(8, 16)

        async def main(n: int = n, max_tokens: int = max_tokens) -> list[dict[str, Any]]:
            async with client(server) as c:
                return await asyncio.gather(*(stream(c, body(i, max_tokens))
                                              for i in range(n)))

        t0 = time.perf_counter()
        results = asyncio.run(main())
        bad = [r for r in results if r["error"] or r["tokens"] != max_tokens
               or r["finish"] != "length"]
        row = {"scenario": f"concurrency {n}", "streams": n, "errors": len(bad),
               "seconds": round(time.perf_counter() - t0, 1), **pool_after(server)}
        judge(row, row["errors"] == 0 and pool_ok(row))
        rows.append(row)
    return rows


def disconnects(server: ServerProcess, opts: BenchOptions) -> list[dict[str, Any]]:
    n = opts.pick(40, 1000)
    max_tokens = opts.pick(16, 32)

    async def main() -> list[dict[str, Any]]:
        async with client(server) as c:
            return await asyncio.gather(*(
                stream(c, body(i, max_tokens), hang_up_after=1 if i % 5 < 2 else None)
                for i in range(n)))

    results = asyncio.run(main())
    stayed = [r for i, r in enumerate(results) if i % 5 >= 2]
    left = [r for i, r in enumerate(results) if i % 5 < 2]
    errors = sum(1 for r in stayed if r["error"] or r["tokens"] != max_tokens)
    errors += sum(1 for r in left if r["error"])
    row = {"scenario": "disconnect storm (40%)", "streams": n, "hung_up": len(left),
           "errors": errors, **pool_after(server)}
    judge(row, errors == 0 and pool_ok(row))
    return [row]


def preemption(opts: BenchOptions, tmp: Path) -> list[dict[str, Any]]:
    """A cache for about four requests (two in the quick run, whose short requests may
    otherwise finish before the last ones arrive on a loaded machine), eight or sixteen at
    once: preemption must not change outputs."""
    n, max_tokens = opts.pick(8, 16), opts.pick(24, 48)
    prompt_len = 64
    blocks = (opts.pick(2, 4) * (prompt_len + max_tokens)) // 16
    server = ServerProcess(opts, tmp / "preemption.log", [
        "--num-kv-blocks", str(blocks), "--max-model-len", str(prompt_len + max_tokens + 16),
        "--max-num-batched-tokens", "128"])
    try:
        server.wait_ready()
        vocab = vocab_of(opts)
        bodies = [{"prompt": [(7 + 13 * i + 31 * j) % (vocab - 3) + 3 for j in range(prompt_len)],
                   "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
                  for i in range(n)]

        async def loaded() -> list[dict[str, Any]]:
            async with client(server) as c:
                return await asyncio.gather(*(stream(c, b) for b in bodies))

        storm = asyncio.run(loaded())
        preempted = server.metrics().get("vllm:num_preemptions_total", 0)
        alone = [httpx.post(f"{server.url}/v1/completions", json=b, timeout=300).json()
                 for b in bodies]
        same = sum(1 for s, a in zip(storm, alone, strict=True)
                   if not s["error"] and s["text"] == a["choices"][0]["text"])
        row = {"scenario": "preemption storm", "requests": n, "kv_blocks": blocks,
               "preemptions": int(preempted), "same_as_alone": same, **pool_after(server)}
        judge(row, same == n and preempted > 0 and pool_ok(row))
        return [row]
    finally:
        server.stop()


def slow_clients(server: ServerProcess, opts: BenchOptions) -> list[dict[str, Any]]:
    """A normal stream beside others that read at once, then beside as many that read one
    line every 0.25 s: the same batch either way, so any difference is the slow readers'."""
    others, max_tokens = opts.pick(10, 50), opts.pick(24, 64)

    async def probe_beside(read_delay: float) -> tuple[list[float], list[dict[str, Any]]]:
        async with client(server) as c:
            tasks = [asyncio.create_task(stream(c, body(i, 4 * max_tokens),
                                                read_delay=read_delay))
                     for i in range(others)]
            while server.metrics().get("vllm:num_requests_running", 0) < others:
                await asyncio.sleep(0.05)
            probe = await stream(c, body(0, max_tokens))
            return gaps(probe["times"]), await asyncio.gather(*tasks)

    fast_itl, fast = asyncio.run(probe_beside(0.0))
    slow_itl, slow = asyncio.run(probe_beside(0.25))
    ratio = statistics.median(slow_itl) / max(statistics.median(fast_itl), 1e-6)
    errors = sum(1 for r in fast + slow if r["error"] or r["tokens"] != 4 * max_tokens)
    row = {"scenario": "slow clients", "other_streams": others,
           "itl_ms_beside_fast_readers": round(1e3 * statistics.median(fast_itl), 1),
           "itl_ms_beside_slow_readers": round(1e3 * statistics.median(slow_itl), 1),
           "itl_ratio": round(ratio, 2), "errors": errors, **pool_after(server)}
    # a stream keeps only its newest output, so a slow reader never holds the engine back
    judge(row, errors == 0 and pool_ok(row), timing=ratio < 1.5)
    return [row]


def _hold_idle_connections(port: int, count: int, conn: Any) -> None:
    """A flood helper process: open `count` connections that never send a byte, report how
    many opened, and at the word "check" how many the server has closed."""
    raise_fd_limit()
    opened, failed = [], 0
    for _ in range(count):
        try:
            opened.append(socket.create_connection(("127.0.0.1", port), timeout=5))
        except OSError:
            failed += 1
    conn.send((len(opened), failed))
    conn.recv()
    closed = 0
    for s in opened:
        s.setblocking(False)
        try:
            closed += s.recv(1) == b""
        except BlockingIOError:
            pass
        except OSError:
            closed += 1
        s.close()
    conn.send(closed)


def idle_flood(server: ServerProcess, opts: BenchOptions) -> list[dict[str, Any]]:
    """Connections that never send a request, from helper processes (one process may hold only
    as many sockets as its descriptor limit allows), while /health is probed."""
    n = opts.pick(2000, 20000)
    per_process = max(1, min(raise_fd_limit(), 20000) - 500)
    procs = -(-n // per_process)
    ctx = multiprocessing.get_context("spawn")
    helpers = []
    for i in range(procs):
        parent, child = ctx.Pipe()
        count = min(per_process, n - i * per_process)
        p = ctx.Process(target=_hold_idle_connections, args=(server.port, count, child),
                        daemon=True)
        p.start()
        helpers.append((p, parent))
    log_before = server.log_lines()
    worst, probes, health_failures = 0.0, 0, 0
    t0 = time.perf_counter()
    pending = list(helpers)
    opened = failed = 0
    with httpx.Client(base_url=server.url, timeout=5) as c:
        while pending or time.perf_counter() - t0 < 3:
            start = time.perf_counter()
            try:
                ok = c.get("/health", headers={"connection": "close"}).status_code == 200
            except httpx.HTTPError:
                ok = False
            worst = max(worst, time.perf_counter() - start)
            probes += 1
            health_failures += not ok
            for helper in list(pending):
                if helper[1].poll():
                    o, f = helper[1].recv()
                    opened, failed = opened + o, failed + f
                    pending.remove(helper)
            time.sleep(0.1)
        completion = c.post("/v1/completions", json=body(0, 4)).status_code
        time.sleep(HEADER_TIMEOUT_S + 1.0)  # past the header timeout: the server closed them
    closed = 0
    for p, parent in helpers:
        parent.send("check")
        closed += parent.recv()
        p.join(30)
    log_lines = server.log_lines() - log_before
    row = {"scenario": "idle connection flood", "connections": opened, "connect_failures": failed,
           "helper_processes": procs, "health_probes": probes,
           "health_failures": health_failures, "health_worst_s": round(worst, 3),
           "closed_by_server": closed, "log_lines": log_lines, "completion_after": completion,
           **pool_after(server)}
    judge(row, log_lines < 100 and opened == n and completion == 200 and closed == opened
          and pool_ok(row), timing=health_failures == 0 and worst < 1.0)
    return [row]


def bad_bodies(vocab: int) -> list[tuple[str, bytes]]:
    return [
        ("invalid JSON", b"{bad"),
        ("not an object", b"[1, 2, 3]"),
        ("lone surrogate", b'{"prompt": "a\\ud800b"}'),
        ("Infinity", b'{"prompt": "x", "temperature": Infinity}'),
        ("1e999", b'{"prompt": "x", "repetition_penalty": 1e999}'),
        ("string number", b'{"prompt": "x", "temperature": "inf"}'),
        ("string bool", b'{"prompt": "x", "stream": "yes"}'),
        ("float token id", b'{"prompt": [1.5, 2]}'),
        ("token id out of vocab", b'{"prompt": [%d]}' % (vocab + 7)),
        ("5000 prompts", json.dumps({"prompt": ["x"] * 5000}).encode()),
        ("n too large", b'{"prompt": "x", "n": 100000}'),
        ("unknown role", b'{"messages": [{"role": "root", "content": "x"}]}'),
        ("deep nesting", b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}"),
        ("empty prompt", b'{"prompt": ""}'),
        ("huge max_tokens", b'{"prompt": "x", "max_tokens": 100000000000000000000}'),
    ]


def huge_inputs(server: ServerProcess, opts: BenchOptions) -> list[dict[str, Any]]:
    max_tokens = opts.pick(48, 128)
    huge_mb = opts.pick(1, 6)  # the quick run's tiny model steps in ~2 ms: a smaller body
    huge = json.dumps({"prompt": "a" * (huge_mb << 20), "max_tokens": 4}).encode()
    headers = {"content-type": "application/json"}

    async def main() -> tuple[dict[str, Any], float, float, int]:
        async with client(server) as c:
            live: dict[str, Any] = {}
            task = asyncio.create_task(stream(c, body(0, max_tokens, temperature=0), out=live))
            while not task.done() and len(live.get("times", ())) < 6:  # let it get going
                await asyncio.sleep(0.01)
            sent = time.perf_counter()
            r = await c.post("/v1/completions", content=huge, headers=headers)
            answered = time.perf_counter()
            return await task, sent, answered, r.status_code

    res, sent, answered, status = asyncio.run(main())
    times = res["times"]
    before = gaps([t for t in times if t < sent])
    during = gaps([t for t in times if sent - 0.5 <= t <= answered + 0.5])
    base = statistics.median(before) if before else float("nan")
    worst_during = max(during) if during else 0.0
    ratio = worst_during / base if before else float("nan")
    statuses = []
    with httpx.Client(base_url=server.url, timeout=60) as c:
        for name, raw in bad_bodies(vocab_of(opts)):
            path = "/v1/chat/completions" if b"messages" in raw[:20] else "/v1/completions"
            statuses.append((name, c.post(path, content=raw, headers=headers).status_code))
    server_errors = [name for name, st in statuses if st >= 500]
    not_4xx = [f"{name}: {st}" for name, st in statuses if not 400 <= st < 500]
    row = {"scenario": "huge and malformed inputs", "huge_prompt_mb": huge_mb,
           "huge_prompt_status": status,
           "huge_prompt_s": round(answered - sent, 3),
           "itl_ms_before": round(1e3 * base, 1),
           "itl_ms_worst_during": round(1e3 * worst_during, 1),
           "itl_ratio": round(ratio, 2), "bad_bodies": len(statuses), "not_4xx": not_4xx,
           "stream_error": res["error"], **pool_after(server)}
    # the stall the huge body may cause: under 2x the stream's inter-token latency (or 20 ms,
    # for a model so small that a step takes a couple of milliseconds)
    judge(row, status == 400 and not server_errors and not not_4xx and not res["error"]
          and pool_ok(row), timing=worst_during < max(2 * base, base + 0.020))
    return [row]


def drain(opts: BenchOptions, tmp: Path) -> list[dict[str, Any]]:
    # long enough that the streams are still running when the probes arrive
    n, max_tokens = opts.pick(10, 50), opts.pick(300, 128)
    server = ServerProcess(opts, tmp / "drain.log", ["--shutdown-timeout", "60",
                                                      "--max-model-len", str(MAX_MODEL_LEN)])
    try:
        server.wait_ready()

        async def main() -> tuple[list[dict[str, Any]], int, int, int]:
            async with client(server) as c:
                tasks = [asyncio.create_task(stream(c, body(i, max_tokens))) for i in range(n)]
                while server.metrics().get("vllm:generation_tokens_total", 0) < n:
                    await asyncio.sleep(0.05)
                server.signal(signal.SIGTERM)
                await asyncio.sleep(0.05)
                health = (await c.get("/health")).status_code
                refused = (await c.post("/v1/completions", json=body(0, 2))).status_code
                running = sum(not t.done() for t in tasks)
                return await asyncio.gather(*tasks), health, refused, running

        results, health, refused, running = asyncio.run(main())
        code = server.proc.wait(90)
    finally:
        server.stop()
    whole = sum(1 for r in results if not r["error"] and r["tokens"] == max_tokens
                and r["finish"] == "length")
    row = {"scenario": "drain on SIGTERM", "streams": n, "in_flight_at_probe": running,
           "finished_whole": whole, "health_while_draining": health,
           "new_request_while_draining": refused, "exit_code": code}
    judge(row, whole == n and code == 0 and health == 503 and refused == 503 and running > 0)
    return [row]


def soak(server: ServerProcess, opts: BenchOptions) -> list[dict[str, Any]]:
    total, batch = opts.pick(100, 2000), 20
    errors = 0
    rss: list[int] = []

    async def one_batch(c: httpx.AsyncClient, start: int) -> int:
        results = await asyncio.gather(*(stream(c, body(start + i, 8)) for i in range(batch)))
        return sum(1 for r in results if r["error"] or r["tokens"] != 8)

    async def main() -> None:
        nonlocal errors
        async with client(server) as c:
            for start in range(0, total, batch):
                errors += await one_batch(c, start)
                rss.append(server.rss_kb())

    asyncio.run(main())
    first = statistics.median(rss[: max(1, len(rss) // 5)])
    last = statistics.median(rss[-max(1, len(rss) // 5):])
    row = {"scenario": "soak", "requests": total, "errors": errors,
           "rss_mb_first_fifth": round(first / 1024, 1),
           "rss_mb_last_fifth": round(last / 1024, 1),
           "rss_growth_pct": round(100 * (last - first) / first, 1), **pool_after(server)}
    judge(row, errors == 0 and pool_ok(row), timing=row["rss_growth_pct"] < 10)
    return [row]


SCENARIOS: list[tuple[str, Callable[..., list[dict[str, Any]]]]] = [
    ("concurrency", concurrency), ("disconnects", disconnects), ("slow", slow_clients),
    ("flood", idle_flood), ("inputs", huge_inputs), ("soak", soak),
]


def run(opts: BenchOptions) -> tuple[BenchResult, PlotFn]:
    t0 = time.perf_counter()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        server = ServerProcess(opts, tmp / "server.log", [
            "--max-model-len", str(MAX_MODEL_LEN), "--header-timeout", str(HEADER_TIMEOUT_S)])
        try:
            server.wait_ready()
            for _, scenario in SCENARIOS:
                rows += scenario(server, opts)
        finally:
            server.stop()
        rows += preemption(opts, tmp)
        rows += drain(opts, tmp)
    md = [f"`octavo serve` ({opts.model or 'SmolLM2-135M-Instruct'} {opts.dtypes[0]}, "
          f"max_model_len {MAX_MODEL_LEN}); every scenario ends with the KV pool checked "
          "(no block in use, nothing running once idle).", "",
          md_table(["scenario", "checks", "timing", "figures"],
                   [[r["scenario"], "yes" if r["checks_ok"] else "**NO**",
                     "yes" if r["timing_ok"] else "**NO**", figures(r)] for r in rows])]
    res = BenchResult("reliability", opts.command, {"quick": opts.quick}, rows, "\n".join(md),
                      elapsed_s=time.perf_counter() - t0)
    return res, plot


def figures(row: dict[str, Any]) -> str:
    skip = ("scenario", "ok", "checks_ok", "timing_ok")
    return ", ".join(f"{k}={v}" for k, v in row.items() if k not in skip)


def plot(rows: list[dict], fig: Figure) -> None:
    ax = fig.add_subplot(1, 1, 1)
    names = [r["scenario"] for r in rows]
    ax.barh(names, [1] * len(rows), color=["#2ca02c" if r["ok"] else "#d62728" for r in rows])
    ax.set_xticks([])
    ax.set_title("reliability scenarios (green: every check held)")
    ax.invert_yaxis()
