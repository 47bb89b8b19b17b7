"""`octavo bench tp`: what tensor parallelism costs on this machine.

The same cores run the model as one rank (tensor_parallel_size 1, every core's threads) and as
two ranks of the `mp` executor (each with half the cores), over two workloads: a `mixed` batch
and a single stream (prompt 256). For the two-rank runs each rank reports the time it spent
inside collectives (the two all-reduces per layer, the embedding's and the LM head's gather);
the lower of the two is the communication itself, the difference between the ranks what the
uneven split of heads (SmolLM2-135M: 3 KV heads, 2 + 1) makes the lighter rank wait.

On a machine of this project's kind (2 cores) two ranks cannot be faster than one: they split
the same cores and add the collectives. What TP would give elsewhere is estimated in the
markdown from these measurements, not measured.
"""

from __future__ import annotations

import gc
import os
from typing import Any

import torch
from matplotlib.figure import Figure

from octavo.bench.common import BenchResult, md_table, median
from octavo.bench.engine_run import make_llm, run_workload
from octavo.bench.options import BenchOptions
from octavo.bench.workloads import BenchRequest, Workload, mixed
from octavo.llm import LLM


def single_stream(prompt_len: int = 256, output_len: int = 128) -> Workload:
    ids = tuple((i * 7919) % 40000 + 100 for i in range(prompt_len))
    return Workload("single", (BenchRequest(ids, output_len),), 2048, {})


def _measure(llm: LLM, wl: Workload, repeats: int) -> dict[str, Any]:
    executor = llm.engine.executor
    runs = []
    for rep in range(repeats):
        executor.collective_stats(reset=True)
        run = run_workload(llm, wl, tag=f"r{rep}-")
        ranks = executor.collective_stats()
        runs.append({"elapsed_s": run.elapsed_s, "output_tok_s": run.output_tok_s,
                     "steps": run.steps, "ranks": ranks})
    best = sorted(runs, key=lambda r: r["output_tok_s"])[len(runs) // 2]  # the median run
    out: dict[str, Any] = {
        "output_tok_s": median([r["output_tok_s"] for r in runs]),
        "runs_tok_s": [round(r["output_tok_s"], 2) for r in runs],
        "steps": best["steps"], "step_ms": 1000 * best["elapsed_s"] / best["steps"],
    }
    if best["ranks"]:
        per_step = [1000 * r["seconds"] / max(r["steps"], 1) for r in best["ranks"]]
        calls = best["ranks"][0]["calls"] / max(best["ranks"][0]["steps"], 1)
        out.update(collective_ms_per_step=per_step,
                   collective_calls_per_step=calls,
                   collective_us_per_call=1000 * min(per_step) / calls if calls else 0.0,
                   collective_share=min(per_step) / out["step_ms"],
                   kb_per_step=best["ranks"][0]["bytes"] / max(best["ranks"][0]["steps"], 1)
                   / 1024)
    return out


def run(opts: BenchOptions) -> tuple[BenchResult, Any]:
    cores = opts.threads or os.cpu_count() or 1
    workloads = [mixed(opts.pick(8, 32), output_len=opts.pick(16, 64), seed=opts.seed),
                 single_stream(output_len=opts.pick(16, 128))]
    repeats = opts.reps(1, 3)
    results: dict[str, dict[str, Any]] = {}
    for tp in (1, 2):
        torch.set_num_threads(max(1, cores if tp == 1 else 1))
        llm = make_llm(opts.model, overrides=opts.engine_overrides,
                       tensor_parallel_size=tp)
        try:
            path = llm.engine.kernel_path()
            for wl in workloads:
                results[f"{wl.name}/tp{tp}"] = {**_measure(llm, wl, repeats),
                                                "kernel_path": path}
        finally:
            llm.shutdown()
            del llm
            gc.collect()
    torch.set_num_threads(cores)
    rows = []
    for wl in workloads:
        one, two = results[f"{wl.name}/tp1"], results[f"{wl.name}/tp2"]
        rows.append([wl.name, one["output_tok_s"], two["output_tok_s"],
                     two["output_tok_s"] / one["output_tok_s"], one["step_ms"], two["step_ms"],
                     " / ".join(f"{x:.2f}" for x in two["collective_ms_per_step"]),
                     two["collective_calls_per_step"], two["collective_us_per_call"],
                     100 * two["collective_share"]])
    markdown = md_table(
        ["workload", "TP=1 tok/s", "TP=2 tok/s", "x TP=1", "TP=1 ms/step", "TP=2 ms/step",
         "collectives ms/step (rank 0 / 1)", "calls/step", "us/call", "% of step"], rows)
    config = {"threads_tp1": cores, "threads_per_rank_tp2": 1, "repeats": repeats,
              "workloads": [wl.describe() for wl in workloads]}
    return BenchResult("tensor_parallel", opts.command, config, results, markdown), plot


def plot(results: dict[str, Any], fig: Figure) -> None:
    ax1, ax2 = fig.subplots(1, 2)
    names = sorted({k.split("/")[0] for k in results})
    x = range(len(names))
    ax1.bar([i - 0.2 for i in x], [results[f"{n}/tp1"]["output_tok_s"] for n in names], 0.4,
            label="TP=1")
    ax1.bar([i + 0.2 for i in x], [results[f"{n}/tp2"]["output_tok_s"] for n in names], 0.4,
            label="TP=2 (mp, gloo)")
    ax1.set_xticks(list(x), names)
    ax1.set_ylabel("output tokens/s")
    ax1.legend()
    ax1.set_title("same cores, one rank or two")
    comm = [min(results[f"{n}/tp2"]["collective_ms_per_step"]) for n in names]
    rest = [results[f"{n}/tp2"]["step_ms"] - c for n, c in zip(names, comm, strict=True)]
    ax2.bar(list(x), rest, label="compute and the rest")
    ax2.bar(list(x), comm, bottom=rest, label="collectives (the faster rank)")
    ax2.set_xticks(list(x), names)
    ax2.set_ylabel("ms per step at TP=2")
    ax2.legend()
    ax2.set_title("where a TP=2 step goes")
