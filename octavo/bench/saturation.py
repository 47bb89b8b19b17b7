"""The server at saturation against the offline engine: does `octavo serve` keep its engine busy?

The same workload (`mixed`: prompts 32-512, 128 output tokens, greedy, ignore_eos) runs three
ways, interleaved in each repeat so that a shared machine's drift hits all three alike:

1. **offline**: `LLM`'s engine stepped in this process on the thread that built it (the
   throughput benchmark's number; no detokenizing);
2. **offline, stepped on a second thread**: the same engine stepped from another thread than
   the one that built and warmed it. This is what the server did before its model was built on
   its engine thread: torch's OpenMP then runs two thread teams and throttles its spin-waiting
   (engine/engine_thread.py), which this row measures by itself, without HTTP;
3. **server**: `octavo serve` in a subprocess, every request sent at once (rate infinity) and
   streamed by the load generator (continuous usage stats in every chunk, detokenized text).

Reported: output tok/s (median of the repeats), the server's share of the offline throughput
(goal >= 0.95), and CPU use (cores busy = CPU seconds / wall seconds) of the engine process,
the server process and the load generator, which shares the machine with the server.
"""

from __future__ import annotations

import resource
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure

from octavo.bench import workloads
from octavo.bench.common import BenchResult, PlotFn, md_table, median
from octavo.bench.engine_run import EngineRun, make_llm, run_workload
from octavo.bench.loadgen import run_load
from octavo.bench.options import BenchOptions
from octavo.bench.server_proc import ServerProcess
from octavo.engine.engine_thread import EngineThread

GOAL = 0.95
WAYS = ("offline", "offline, 2nd thread", "server")


def process_cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def on_second_thread(llm, wl: workloads.Workload, tag: str) -> EngineRun:
    """Step `llm` from a fresh thread, not the one that built and warmed it."""
    thread = EngineThread(name="bench-second-thread")
    try:
        return thread.call(run_workload, llm, wl, tag=tag)
    finally:
        thread.close()


def offline_sample(run: Callable[..., EngineRun], *args: Any, **kwargs: Any
                   ) -> dict[str, float]:
    c = process_cpu_s()
    r = run(*args, **kwargs)
    return {"output_tok_s": r.output_tok_s, "cores_busy": (process_cpu_s() - c) / r.elapsed_s}


def workload(opts: BenchOptions) -> workloads.Workload:
    vocab = 256 if opts.model else workloads.SMOLLM2_VOCAB
    return workloads.mixed(opts.num_requests or opts.pick(12, 64),
                           output_len=opts.pick(16, 128),
                           max_prompt=120 if opts.model else opts.pick(128, 512),
                           vocab=vocab, seed=opts.seed)


def run(opts: BenchOptions) -> tuple[BenchResult, PlotFn]:
    t0 = time.perf_counter()
    wl = workload(opts)
    repeats = opts.reps(1, 3)
    dtype = opts.dtypes[0]
    max_len = 512 if opts.model else 2048
    warm = workloads.Workload("warm", wl.requests[:2], max_len).capped(4)
    llm = make_llm(opts.model, dtype=dtype, overrides=opts.engine_overrides,
                   max_model_len=max_len)
    run_workload(llm, warm, tag="warm-")
    samples: dict[str, list[dict]] = {w: [] for w in WAYS}
    with tempfile.TemporaryDirectory() as tmp:
        server = ServerProcess(opts, Path(tmp) / "server.log",
                               ["--no-enable-prefix-caching", "--max-model-len", str(max_len)])
        try:
            server.wait_ready()
            run_load(server.url, "bench", warm, float("inf"), timeout_s=120)
            for rep in range(repeats):
                samples["offline"].append(
                    offline_sample(run_workload, llm, wl, tag=f"o{rep}-"))
                samples["offline, 2nd thread"].append(
                    offline_sample(on_second_thread, llm, wl, f"t{rep}-"))
                c, sc = process_cpu_s(), server.cpu_s()
                res = run_load(server.url, "bench", wl, float("inf"),
                               timeout_s=opts.pick(300, 1800))
                if res["errors"] or res["completed"] != len(wl) or res["short_outputs"]:
                    raise RuntimeError(f"the server failed requests: {res['errors']}, "
                                       f"{res['completed']}/{len(wl)} done, "
                                       f"{res['short_outputs']} short")
                samples["server"].append({
                    "output_tok_s": res["output_tok_s"],
                    "cores_busy": (server.cpu_s() - sc) / res["duration_s"],
                    "client_cores_busy": (process_cpu_s() - c) / res["duration_s"],
                    "ttft_ms_p50": res["ttft_ms_p50"], "tpot_ms_p50": res["tpot_ms_p50"]})
            idle = server.wait_idle()
        finally:
            server.stop()
    offline = median([s["output_tok_s"] for s in samples["offline"]])
    rows = []
    for way in WAYS:
        xs = samples[way]
        row = {"way": way, "output_tok_s": median([s["output_tok_s"] for s in xs]),
               "cores_busy": median([s["cores_busy"] for s in xs]),
               "runs": [round(s["output_tok_s"], 1) for s in xs]}
        row["x_offline"] = row["output_tok_s"] / offline
        if way == "server":
            row["client_cores_busy"] = median([s["client_cores_busy"] for s in xs])
            row["ttft_ms_p50"] = median([s["ttft_ms_p50"] for s in xs])
            row["tpot_ms_p50"] = median([s["tpot_ms_p50"] for s in xs])
        rows.append(row)
    server_row = rows[-1]
    md = [
        f"Workload {wl.describe()}, {dtype}, {opts.threads} threads, prefix caching off, "
        f"median of {repeats} interleaved repeats. Kernel path: "
        f"`{llm.engine.runner.kernel_path()}`.",
        "",
        md_table(["way", "output tok/s", "x offline", "cores busy", "runs"],
                 [[r["way"], r["output_tok_s"], f"{r['x_offline']:.3f}", r["cores_busy"],
                   " / ".join(map(str, r["runs"]))] for r in rows], 2),
        "",
        f"Server: {server_row['x_offline']:.3f} of offline (goal >= {GOAL}); the load "
        f"generator used {server_row['client_cores_busy']:.2f} cores beside it; TTFT p50 "
        f"{server_row['ttft_ms_p50']:.0f} ms, TPOT p50 {server_row['tpot_ms_p50']:.0f} ms. "
        f"KV blocks held after the runs: {idle.get('octavo:kv_blocks_used', 0):.0f}.",
    ]
    result = BenchResult(
        "saturation", opts.command,
        {"workload": wl.describe(), "dtype": dtype, "threads": opts.threads,
         "repeats": repeats, "goal_x_offline": GOAL,
         "kernel_path": llm.engine.runner.kernel_path()},
        {"rows": rows, "samples": samples,
         "kv_blocks_used_after": idle.get("octavo:kv_blocks_used", 0)},
        "\n".join(md), elapsed_s=time.perf_counter() - t0)
    return result, plot


def plot(results: dict, fig: Figure) -> None:
    rows = results["rows"]
    ax = fig.add_subplot(1, 1, 1)
    xs = range(len(rows))
    ax.bar(xs, [r["output_tok_s"] for r in rows], color=["C0", "C1", "C2"][:len(rows)])
    for i, r in enumerate(rows):
        ax.text(i, r["output_tok_s"], f"{r['x_offline']:.2f}x\n{r['cores_busy']:.2f} cores",
                ha="center", va="bottom", fontsize=9)
    offline = rows[0]["output_tok_s"]
    ax.axhline(GOAL * offline, color="0.4", ls="--", lw=1, label=f"{GOAL:.0%} of offline")
    ax.set_xticks(list(xs), [r["way"] for r in rows])
    ax.set_ylabel("output tok/s (median)")
    ax.set_title("The server at saturation vs the offline engine (same workload)")
    ax.legend(loc="lower right")
