"""How many requests run at once on one KV budget: paged versus contiguous reservation.

The claim paging makes is about memory, so it is measured where memory decides: the engine's
scheduler, with no model (sim.py), replays one ShareGPT-like trace (all requests at once)
through each allocator at the same budget and counts running sequences while requests are
still queued (the memory-bound regime; the drain tail, when one long request runs alone, is not
concurrency the allocator chose). Throughput there is requests finished per 1000 decode steps,
proportional to requests/s when a step costs about the same (it does not quite: bigger batches
take longer per step, which is why the full run also runs the real engine with its model).

Full runs confirm on the engine with the embedded model at a small KV budget, using
LLM(kv_allocator=..., kv_cache_memory_bytes=...) and stats()["peak_running_seqs"].

KV dtypes (kv_cache_dtype): at one byte budget (KV_DTYPE_BF16_TOKENS tokens of bf16 pages), how
many tokens the paged cache holds and how many sequences run with pages in fp32, bf16, int8
(scales included) and fp8: simulated on the same trace as above, and on the engine (full
runs). An engine whose CPU does not compute bf16 (dtype_policy.py) cannot store bf16 pages;
its bf16 row runs fp32 pages cut into the block count bf16 pages would get at that budget,
which is all the scheduler sees, and says so.
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
KV_DTYPE_BF16_TOKENS = 8192  # the simulated byte budget, in tokens of bf16 pages
KV_DTYPES = ("float32", "bfloat16", "int8", "fp8_e4m3")
KV_DTYPE_GOALS = {"bfloat16": 1.85, "float32": 3.7}  # quantized rows against these


def kv_bytes_per_token(model: str | None, dtype: str) -> int:
    from octavo.config import ModelConfig
    from octavo.model.sources import resolve_model_dir

    cfg = ModelConfig.from_dir(resolve_model_dir(model))
    return cfg.kv_bytes_per_token(2 if dtype in ("bfloat16", "float16") else 4)


def kv_dtype_bytes_per_token(model: str | None, kv_dtype: str) -> int:
    """Bytes a token's K and V take in every layer with pages of `kv_dtype` (float32 / bfloat16:
    the model dtype's pages; int8 / fp8_*: kv_cache_dtype, scales included)."""
    import torch

    from octavo.config import ModelConfig
    from octavo.model.layers.kv_cache import KVCache
    from octavo.model.layers.kv_quant import kv_format
    from octavo.model.sources import resolve_model_dir

    cfg = ModelConfig.from_dir(resolve_model_dir(model))
    plain = kv_dtype in ("float32", "bfloat16")
    dtype = getattr(torch, kv_dtype) if plain else torch.float32
    fmt = kv_format("auto" if plain else kv_dtype, dtype)
    return KVCache.bytes_per_block(cfg, 1, dtype, fmt)


def kv_dtype_sims(opts: BenchOptions, wl: workloads.Workload) -> dict[str, dict]:
    """Paged, the same trace, one byte budget: each KV dtype's tokens and running sequences."""
    budget = KV_DTYPE_BF16_TOKENS * kv_dtype_bytes_per_token(opts.model, "bfloat16")
    out = {}
    for name in KV_DTYPES:
        per_token = kv_dtype_bytes_per_token(opts.model, name)
        tokens = budget // per_token // 16 * 16
        sim = simulate(wl, "paged", kv_tokens=tokens, block_size=16, seed=opts.seed)
        out[name] = {"kv_bytes": budget, "kv_bytes_per_token": per_token, "kv_tokens": tokens,
                     "loaded_running": sim.loaded_running, "peak_running": sim.peak_running,
                     "preemptions": sim.preemptions}
    return out


def kv_dtype_engine_runs(opts: BenchOptions) -> list[dict]:
    """The engine at one kv_cache_memory_bytes (ENGINE_KV_TOKENS tokens of bf16 pages)."""
    from octavo.bench.engine_run import effective_dtype

    wl = engine_trace(opts)
    budget = ENGINE_KV_TOKENS * kv_dtype_bytes_per_token(opts.model, "bfloat16")
    rows = []
    for name in KV_DTYPES:
        options: dict = {"kv_cache_memory_bytes": budget, "dtype": "float32"}
        note = ""
        if name == "bfloat16":
            if effective_dtype(opts.model, "bfloat16", opts.engine_overrides) == "bfloat16":
                options["dtype"] = "bfloat16"
            else:  # the block count bf16 pages get; the scheduler sees nothing else
                blocks = budget // (16 * kv_dtype_bytes_per_token(opts.model, "bfloat16"))
                options = {"num_kv_blocks": blocks, "dtype": "float32"}
                note = "bf16 block count, fp32 pages (no native bf16 here)"
        elif name != "float32":
            options["kv_cache_dtype"] = name
        llm = make_llm(opts.model, overrides=opts.engine_overrides,
                       max_model_len=ENGINE_MAX_MODEL_LEN, **options)
        run = run_workload(llm, wl, sample=lambda s: {
            "running": s["num_requests_running"], "waiting": s["num_requests_waiting"]})
        loaded = [s["running"] for s in run.samples if s["waiting"] > 0]
        rows.append({
            "kv_dtype": name, "note": note, "kv_cache_memory_bytes": budget,
            "kv_tokens": run.final_stats["kv_blocks_total"] * 16,
            "kv_bytes_per_token": kv_dtype_bytes_per_token(opts.model, name),
            "peak_running_seqs": run.final_stats["peak_running_seqs"],
            "mean_running_while_queued": sum(loaded) / max(len(loaded), 1),
            "output_tok_s": run.output_tok_s, "preemptions": run.final_stats["num_preemptions"],
            "trace": wl.describe(),
        })
        del llm
    return rows


def kv_dtype_markdown(sims: dict[str, dict], engine: list[dict]) -> list[str]:
    def ratios(value: float, base: dict[str, float]) -> str:
        return ", ".join(f"{value / base[b]:.2f}x {b} (goal {g}x: "
                         f"{'met' if value / base[b] >= g else 'NOT met'})"
                         for b, g in KV_DTYPE_GOALS.items())

    first = next(iter(sims.values()))
    md = ["", f"KV dtypes, simulated (paged, block size 16, the trace above), at one budget of "
          f"{first['kv_bytes']} bytes ({KV_DTYPE_BF16_TOKENS} tokens of bf16 pages):", ""]
    tok = {n: r["kv_tokens"] for n, r in sims.items()}
    run = {n: r["loaded_running"] for n, r in sims.items()}
    md.append(md_table(["pages", "bytes/token", "KV tokens", "running (queued)", "peak running",
                        "KV tokens vs", "running vs"],
                       [[n, r["kv_bytes_per_token"], r["kv_tokens"], r["loaded_running"],
                         r["peak_running"], ratios(r["kv_tokens"], tok) if n in
                         ("int8", "fp8_e4m3") else "",
                         ratios(r["loaded_running"], run) if n in ("int8", "fp8_e4m3") else ""]
                        for n, r in sims.items()]))
    if engine:
        tok = {r["kv_dtype"]: r["kv_tokens"] for r in engine}
        run = {r["kv_dtype"]: r["mean_running_while_queued"] for r in engine}
        md += ["", f"KV dtypes on the engine, one kv_cache_memory_bytes "
               f"({engine[0]['kv_cache_memory_bytes']} bytes = {ENGINE_KV_TOKENS} tokens of bf16 "
               f"pages), trace {engine[0]['trace']}:", "",
               md_table(["pages", "bytes/token", "KV tokens", "peak running",
                         "running (queued)", "out tok/s", "preemptions", "KV tokens vs",
                         "running vs", "note"],
                        [[r["kv_dtype"], r["kv_bytes_per_token"], r["kv_tokens"],
                          r["peak_running_seqs"], r["mean_running_while_queued"],
                          r["output_tok_s"], r["preemptions"],
                          ratios(r["kv_tokens"], tok) if r["kv_dtype"] in ("int8", "fp8_e4m3")
                          else "",
                          ratios(r["mean_running_while_queued"], run)
                          if r["kv_dtype"] in ("int8", "fp8_e4m3") else "", r["note"]]
                         for r in engine])]
    return md


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
    kv_sims = kv_dtype_sims(opts, wl)
    engine_rows: list[dict] = []
    kv_engine: list[dict] = []
    if not opts.quick:
        engine_rows = engine_runs(opts)
        kv_engine = kv_dtype_engine_runs(opts)
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
    md += kv_dtype_markdown(kv_sims, kv_engine)
    results = {"simulated": sims, "engine": engine_rows,
               "kv_dtypes_simulated": kv_sims, "kv_dtypes_engine": kv_engine,
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
