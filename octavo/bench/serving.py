"""Online serving: `octavo serve` (paged vs contiguous) under Poisson load at several rates.

The server runs as a subprocess on a free 127.0.0.1 port (loopback only) with a small KV budget
and max_model_len 512, so that memory, not only compute, limits how many requests run at once:
the contiguous allocator reserves 512 slots per request and fits budget / 512 of them. Each rate
sends a fixed, seeded set of requests (open loop) and reports TTFT, TPOT and ITL percentiles,
throughput and normalized latency (latency / output tokens), plotted against the request rate as
in the vLLM paper (Fig. 12): the knee of that curve is the rate a system can sustain.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from matplotlib.figure import Figure

from octavo.bench import workloads
from octavo.bench.common import BenchResult, PlotFn, md_table
from octavo.bench.concurrency import kv_bytes_per_token
from octavo.bench.loadgen import run_load
from octavo.bench.options import BenchOptions
from octavo.bench.server_proc import ServerProcess

MAX_MODEL_LEN = 512
KV_TOKENS = 4096
SERVERS = ("paged", "contiguous")


def server_flags(opts: BenchOptions, allocator: str) -> list[str]:
    dtype = opts.dtypes[0]
    return ["--kv-allocator", allocator, "--max-model-len", str(MAX_MODEL_LEN),
            "--no-enable-prefix-caching",
            "--kv-cache-memory-bytes", str(KV_TOKENS * kv_bytes_per_token(opts.model, dtype))]


def trace(opts: BenchOptions, rate_index: int) -> workloads.Workload:
    vocab = 256 if opts.model else workloads.SMOLLM2_VOCAB
    n = opts.num_requests or opts.pick(6, 24)
    wl = workloads.sharegpt(n, mean_in=64, mean_out=64, max_model_len=MAX_MODEL_LEN,
                            vocab=vocab, seed=opts.seed + rate_index)
    return wl.capped(opts.pick(16, 128))


def run(opts: BenchOptions) -> tuple[BenchResult, PlotFn]:
    t0 = time.perf_counter()
    rates = [2.0] if opts.quick else [0.5, 1.0, 2.0, 4.0]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for allocator in SERVERS:
            server = ServerProcess(opts, Path(tmp) / f"{allocator}.log",
                                   server_flags(opts, allocator))
            try:
                server.wait_ready()
                warm = trace(opts, 999).capped(2)
                run_load(server.url, "bench", workloads.Workload(
                    "warm", warm.requests[:2], MAX_MODEL_LEN), float("inf"), timeout_s=120)
                for i, rate in enumerate(rates):
                    res = run_load(server.url, "bench", trace(opts, i), rate,
                                   seed=opts.seed + i, timeout_s=opts.pick(120, 400))
                    rows.append({"server": allocator, **res})
            finally:
                server.stop()
    md = [
        f"`octavo serve` ({opts.model or 'SmolLM2-135M-Instruct'} {opts.dtypes[0]}, KV budget "
        f"{KV_TOKENS} tokens, max_model_len {MAX_MODEL_LEN}, prefix caching off), "
        f"{len(trace(opts, 0))} requests per rate, trace {trace(opts, 0).describe()}; "
        "Poisson arrivals, one seeded run per rate (latency percentiles are over requests "
        "and tokens within it).",
        "",
        md_table(["server", "rate req/s", "done", "req/s", "out tok/s", "TTFT p50 ms",
                  "TTFT p99 ms", "TPOT p50 ms", "TPOT p99 ms", "ITL p50 ms", "ITL p99 ms",
                  "norm. latency s/tok"],
                 [[r["server"], r["rate"], f"{r['completed']}/{r['requests']}", r["req_s"],
                   r["output_tok_s"], r["ttft_ms_p50"], r["ttft_ms_p99"], r["tpot_ms_p50"],
                   r["tpot_ms_p99"], r["itl_ms_p50"], r["itl_ms_p99"],
                   f"{r['norm_latency_s_per_tok_mean']:.3f}"] for r in rows], 1),
    ]
    if any(r["errors"] for r in rows):
        md += ["", "Errors: " + "; ".join(f"{r['server']}@{r['rate']}: {r['errors']}"
                                          for r in rows if r["errors"])]
    res = BenchResult("serving", opts.command,
                      {"rates": rates, "kv_tokens": KV_TOKENS, "max_model_len": MAX_MODEL_LEN,
                       "trace": trace(opts, 0).describe()}, rows, "\n".join(md),
                      elapsed_s=time.perf_counter() - t0)
    return res, plot


def plot(rows: list[dict], fig: Figure) -> None:
    ax = fig.add_subplot(1, 2, 1)
    for server in SERVERS:
        sub = [r for r in rows if r["server"] == server]
        ax.plot([r["rate"] for r in sub], [r["norm_latency_s_per_tok_mean"] for r in sub],
                "o-", label=server)
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("normalized latency (s/token)")
    ax.set_title("normalized latency vs load")
    ax.legend()
    ax = fig.add_subplot(1, 2, 2)
    for server, color in zip(SERVERS, ("#1f77b4", "#ff7f0e"), strict=True):
        sub = [r for r in rows if r["server"] == server]
        ax.plot([r["rate"] for r in sub], [r["ttft_ms_p50"] / 1e3 for r in sub], "o-",
                color=color, label=f"{server} TTFT p50")
        ax.plot([r["rate"] for r in sub], [r["ttft_ms_p99"] / 1e3 for r in sub], "x--",
                color=color, label=f"{server} TTFT p99")
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("time to first token (s)")
    ax.set_yscale("log")
    ax.legend(fontsize=7)
