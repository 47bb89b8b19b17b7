"""How many requests run at once on one KV budget: paged versus contiguous reservation.

The claim paging makes is about memory, so it is measured where memory decides: the simulated
scheduler replays one ShareGPT-like trace (all requests at once) through each allocator at the
same budget and counts running sequences while requests are still queued (the memory-bound
regime; the drain tail, when one long request runs alone, is not concurrency the allocator
chose). Throughput there is requests finished per 1000 decode steps, proportional to requests/s
when a step costs about the same (it does not quite: bigger batches take longer per step, which
is why the full run also runs the real engine).

Full runs confirm on the engine with the embedded model at a small KV budget, using
LLM(kv_allocator=..., kv_cache_memory_bytes=...) and stats()["peak_running_seqs"].
"""

from __future__ import annotations

import time
from dataclasses import asdict

from matplotlib.figure import Figure

from octavo.bench import workloads
from octavo.bench.common import BenchResult, PlotFn, md_table, median
from octavo.bench.engine_run import make_llm, run_workload
from octavo.bench.options import BenchOptions
from octavo.bench.sim import ALLOCATORS, simulate
from octavo.bench.waste import KV_TOKENS, WINDOW

ENGINE_KV_TOKENS = 2048
ENGINE_MAX_MODEL_LEN = 512
GOAL = 4.0


def kv_bytes_per_token(model: str | None, dtype: str) -> int:
    from octavo.config import ModelConfig
    from octavo.model.sources import resolve_model_dir

    cfg = ModelConfig.from_dir(resolve_model_dir(model))
    return cfg.kv_bytes_per_token(2 if dtype in ("bfloat16", "float16") else 4)


def engine_trace(opts: BenchOptions) -> workloads.Workload:
    """ShareGPT's shape shrunk to a 512-token context so a CPU finishes it in a minute."""
    vocab = 256 if opts.model else workloads.SMOLLM2_VOCAB
    return workloads.sharegpt(opts.pick(16, 64), mean_in=48, mean_out=64,
                              max_model_len=ENGINE_MAX_MODEL_LEN, vocab=vocab, seed=opts.seed)


def engine_runs(opts: BenchOptions) -> list[dict]:
    wl = engine_trace(opts)
    dtype = opts.dtypes[0]
    kv_bytes = ENGINE_KV_TOKENS * kv_bytes_per_token(opts.model, dtype)
    rows = []
    for kind in ALLOCATORS:
        llm = make_llm(opts.model, overrides=opts.engine_overrides, dtype=dtype, allocator=kind,
                       kv_cache_memory_bytes=kv_bytes, max_model_len=ENGINE_MAX_MODEL_LEN)
        run = run_workload(llm, wl, sample=lambda s: {
            "running": s["num_requests_running"], "waiting": s["num_requests_waiting"]})
        loaded = [s["running"] for s in run.samples if s["waiting"] > 0]
        every = [s["running"] for s in run.samples]
        rows.append({
            "allocator": kind,
            "peak_running_seqs": run.final_stats["peak_running_seqs"],
            "mean_running_while_queued": sum(loaded) / max(len(loaded), 1),
            "mean_running": sum(every) / max(len(every), 1),
            "steps": run.steps,
            "elapsed_s": run.elapsed_s,
            "req_s": run.req_s,
            "output_tok_s": run.output_tok_s,
            "preemptions": run.final_stats["num_preemptions"],
        })
        del llm
    return [{**r, "trace": wl.describe(), "kv_cache_memory_bytes": kv_bytes, "dtype": dtype}
            for r in rows]


def run(opts: BenchOptions) -> tuple[BenchResult, PlotFn]:
    t0 = time.perf_counter()
    wl = workloads.sharegpt(opts.num_requests or opts.pick(300, 1000), seed=opts.seed)
    sims = {}
    for kind in ALLOCATORS:
        sims[kind] = asdict(simulate(wl, kind, kv_tokens=KV_TOKENS, block_size=16,
                                     seed=opts.seed))
    # a Mistral-style model whose every layer slides: paging keeps only the window's blocks
    sims[f"paged window={WINDOW}"] = asdict(simulate(wl, "paged", kv_tokens=KV_TOKENS,
                                                     block_size=16, seed=opts.seed,
                                                     window=WINDOW))
    base = sims["contiguous-max"]
    rows = []
    for kind, r in sims.items():
        rows.append([
            kind, r["loaded_running"], r["peak_running"],
            r["loaded_running"] / base["loaded_running"],
            r["loaded_requests_per_1k_steps"],
            r["loaded_requests_per_1k_steps"] / base["loaded_requests_per_1k_steps"],
            r["requests_per_1k_steps"], r["num_steps"], r["preemptions"], r["max_seq_slots"],
        ])
    ratio = sims["paged"]["loaded_running"] / base["loaded_running"]
    md = [
        f"Simulated, KV budget {KV_TOKENS} token slots, paged block size 16, trace "
        f"{wl.describe()}, all requests at once.",
        "",
        md_table(["allocator", "running (queued)", "peak running", "x contig-max",
                  "req/1k steps (queued)", "x contig-max", "req/1k steps (all)", "steps",
                  "preemptions", "max slots / seq"], rows),
        "",
        f"Goal >= {GOAL:.0f}x the concurrency of max-length contiguous reservation: "
        f"{ratio:.2f}x -> {'met' if ratio >= GOAL else 'NOT met'}.",
        "",
        f"Sliding window {WINDOW} (every layer): "
        f"{sims[f'paged window={WINDOW}']['loaded_running'] / sims['paged']['loaded_running']:.2f}x"
        " the concurrency of full-attention paging on the same budget, each sequence holding "
        f"at most {sims[f'paged window={WINDOW}']['max_seq_slots']} slots.",
    ]
    engine_rows: list[dict] = []
    if not opts.quick:
        engine_rows = engine_runs(opts)
        b = next(r for r in engine_rows if r["allocator"] == "contiguous-max")
        md += [
            "",
            f"Engine, {opts.model or 'SmolLM2-135M'} {engine_rows[0]['dtype']}, KV budget "
            f"{ENGINE_KV_TOKENS} tokens ({engine_rows[0]['kv_cache_memory_bytes']} bytes), "
            f"max_model_len {ENGINE_MAX_MODEL_LEN}, trace {engine_rows[0]['trace']} (one run "
            "each: the concurrency counts are deterministic; the times are not):",
            "",
            md_table(["allocator", "peak_running_seqs", "running (queued)", "x contig-max",
                      "running (all steps)", "steps", "req/s", "x contig-max", "preemptions"], [
                [r["allocator"], r["peak_running_seqs"], r["mean_running_while_queued"],
                 r["mean_running_while_queued"] / b["mean_running_while_queued"],
                 r["mean_running"], r["steps"],
                 r["req_s"], r["req_s"] / b["req_s"], r["preemptions"]]
                for r in engine_rows]),
        ]
    results = {"simulated": sims, "engine": engine_rows,
               "paged_vs_contiguous_max": ratio,
               "median_engine_req_s": median([r["req_s"] for r in engine_rows])}
    config = {"kv_tokens": KV_TOKENS, "block_size": 16, "trace": wl.describe(), "window": WINDOW,
              "engine_kv_tokens": ENGINE_KV_TOKENS, "engine_max_model_len": ENGINE_MAX_MODEL_LEN}
    res = BenchResult("concurrency", opts.command, config, results, "\n".join(md),
                      elapsed_s=time.perf_counter() - t0)
    return res, plot


def plot(results: dict, fig: Figure) -> None:
    sims = results["simulated"]
    ax = fig.add_subplot(1, 2, 1)
    for kind, r in sims.items():
        series = r["running_series"]
        stride = max(1, r["num_steps"] // max(len(series), 1))
        ax.plot([i * stride for i in range(len(series))], series, label=kind, lw=1)
    ax.set_xlabel("decode step")
    ax.set_ylabel("requests running")
    ax.set_title("simulated, same KV budget and trace")
    ax.legend(fontsize=8)
    ax = fig.add_subplot(1, 2, 2)
    kinds = list(sims)
    ax.bar([k + "\n(sim)" for k in kinds], [sims[k]["loaded_running"] for k in kinds],
           color="#4c72b0")
    if results["engine"]:
        eng = results["engine"]
        ax.bar([r["allocator"] + "\n(engine)" for r in eng],
               [r["mean_running_while_queued"] for r in eng], color="#55a868")
    ax.set_ylabel("mean requests running while others queue")
    ax.tick_params(axis="x", rotation=30, labelsize=7)
    ax.set_title("concurrency")
