"""Automatic prefix caching: groups of requests sharing a 512-token prefix, cache on vs off.

With caching on, the first request of a group computes the shared prefix and registers its full
blocks; the others find them by chained hash and prefill only their own 64-token suffix (plus
the shared prefix's unfilled last block, if any). Outputs are short, so prefill dominates, as in
system-prompt-heavy chat or few-shot traffic. Each repeat uses fresh prefixes (seed + repeat)
so that a repeat never hits blocks cached by the previous one; repeats are interleaved.
"""

from __future__ import annotations

import time

from matplotlib.figure import Figure

from octavo.bench import workloads
from octavo.bench.common import BenchResult, PlotFn, md_table, median
from octavo.bench.engine_run import make_llm, run_workload
from octavo.bench.options import BenchOptions


def trace(opts: BenchOptions, rep: int) -> workloads.Workload:
    tiny = opts.model is not None  # the tiny test model has 512 positions and 256 ids
    return workloads.prefix(
        num_groups=opts.pick(2, 4), per_group=opts.num_requests or opts.pick(3, 8),
        prefix_len=256 if tiny else 512, suffix_len=32 if tiny else 64,
        output_len=opts.pick(4, 16), vocab=256 if tiny else workloads.SMOLLM2_VOCAB,
        seed=opts.seed + rep)


def run(opts: BenchOptions) -> tuple[BenchResult, PlotFn]:
    t0 = time.perf_counter()
    repeats = opts.reps(1, 3)
    dtype = opts.dtypes[0]
    llms = {on: make_llm(opts.model, overrides=opts.engine_overrides, dtype=dtype,
                         enable_prefix_caching=on, max_model_len=512 if opts.model else 2048)
            for on in (False, True)}
    warm = trace(opts, 10_000).capped(2)
    for llm in llms.values():
        run_workload(llm, workloads.Workload("warm", warm.requests[:2], 2048), tag="w")
    raw: dict[bool, list[dict]] = {False: [], True: []}
    for rep in range(repeats):
        wl = trace(opts, rep)
        for on, llm in llms.items():
            before = llm.stats()
            r = run_workload(llm, wl, tag=f"r{rep}-")
            after = r.final_stats
            query = after["prefix_cache_query_tokens"] - before["prefix_cache_query_tokens"]
            hits = after["prefix_cache_hit_tokens"] - before["prefix_cache_hit_tokens"]
            computed = after["prompt_tokens_total"] - before["prompt_tokens_total"]
            raw[on].append({"elapsed_s": r.elapsed_s, "query_tokens": query, "hit_tokens": hits,
                            "prompt_tokens": wl.prompt_tokens, "prefill_computed": computed,
                            "req_s": r.req_s, "output_tok_s": r.output_tok_s})
    rows = []
    for on, runs in raw.items():
        t = median([r["elapsed_s"] for r in runs])
        prompt = runs[0]["prompt_tokens"]
        computed = median([r["prefill_computed"] for r in runs])
        rows.append({
            "prefix_caching": on, "median_s": t, "times_s": [r["elapsed_s"] for r in runs],
            "req_s": len(trace(opts, 0)) / t,
            "hit_rate": median([r["hit_tokens"] / max(r["query_tokens"], 1) for r in runs]),
            "prompt_tokens": prompt, "prefill_computed": computed,
            "prefill_saved": 1 - computed / prompt,
        })
    speedup = rows[1]["req_s"] / rows[0]["req_s"]
    wl = trace(opts, 0)
    g, k = wl.params["num_groups"], wl.params["per_group"]
    ideal = (k - 1) / k * (wl.params["prefix_len"] // 16 * 16) / (wl.prompt_tokens / len(wl))
    md = [
        f"{opts.model or 'SmolLM2-135M-Instruct'} {dtype}, block size 16, trace "
        f"{wl.describe()}, median of {repeats} interleaved repeats (fresh prefixes each).",
        "",
        md_table(["prefix caching", "median s", "req/s", "hit rate (of queried tokens)",
                  "prefill tokens computed", "of prompt tokens", "prefill saved", "times s"],
                 [["on" if r["prefix_caching"] else "off", r["median_s"], r["req_s"],
                   f"{100 * r['hit_rate']:.1f}%", r["prefill_computed"], r["prompt_tokens"],
                   f"{100 * r['prefill_saved']:.1f}%",
                   " ".join(f"{t:.1f}" for t in r["times_s"])] for r in rows]),
        "",
        f"Throughput with caching / without: {speedup:.2f}x. Best possible prefill saving for "
        f"{g} groups of {k}: {100 * ideal:.1f}% (every request but the first of its group "
        "reuses the prefix's full blocks).",
    ]
    res = BenchResult("prefix", opts.command,
                      {"trace": wl.describe(), "repeats": repeats, "dtype": dtype},
                      {"rows": rows, "speedup": speedup, "ideal_prefill_saved": ideal},
                      "\n".join(md), elapsed_s=time.perf_counter() - t0)
    return res, plot


def plot(results: dict, fig: Figure) -> None:
    rows = results["rows"]
    labels = ["caching off", "caching on"]
    ax = fig.add_subplot(1, 2, 1)
    ax.bar(labels, [r["req_s"] for r in rows], color=["#8c8c8c", "#4c72b0"])
    ax.set_ylabel("requests/s (median)")
    ax.set_title(f"throughput: {results['speedup']:.2f}x with prefix caching")
    ax = fig.add_subplot(1, 2, 2)
    ax.bar(labels, [r["prefill_computed"] for r in rows], color=["#8c8c8c", "#4c72b0"])
    ax.axhline(rows[0]["prompt_tokens"], ls="--", color="0.3", lw=1, label="prompt tokens")
    ax.set_ylabel("prefill tokens computed")
    ax.set_title("prefill work")
    ax.legend(fontsize=8)
