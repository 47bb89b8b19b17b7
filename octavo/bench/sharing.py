"""Memory saved by sharing blocks: parallel sampling (n samples) and beam search (k beams).

A parallel-sampling request forks its prompt's blocks to n sequences; a beam request forks and
frees beams every step. Blocks shared by several block tables count once in the pool, so each
step we sample `kv_blocks_saved_by_sharing` (table entries minus distinct blocks) and
`kv_blocks_used`; the saving is saved / (used + saved): the share of the memory the same
requests would need without sharing. The vLLM paper (Fig. 15, OPT-13B) reports 6.1-9.8%
(parallel) and 37.6-55.2% (beam) on Alpaca, and 16.2-30.5% / 44.3-66.3% on ShareGPT.
Prefix caching is off so that only forks share.
"""

from __future__ import annotations

import time

from matplotlib.figure import Figure

from octavo.bench import workloads
from octavo.bench.common import BenchResult, PlotFn, md_table
from octavo.bench.engine_run import make_llm, run_workload
from octavo.bench.options import BenchOptions

PAPER = {("parallel", "alpaca"): "6.1-9.8%", ("beam", "alpaca"): "37.6-55.2%",
         ("parallel", "sharegpt"): "16.2-30.5%", ("beam", "sharegpt"): "44.3-66.3%"}


def traces(opts: BenchOptions) -> list[workloads.Workload]:
    """CPU scale: 4 ShareGPT-like requests (prompts capped at a quarter of the context,
    outputs at 128) and 8 Alpaca-like ones."""
    vocab = 256 if opts.model else workloads.SMOLLM2_VOCAB
    max_len = 512 if opts.model else 2048
    if opts.quick:
        return [workloads.alpaca(4, vocab=vocab, seed=opts.seed,
                                 max_model_len=max_len).capped(16)]
    return [
        workloads.sharegpt(opts.num_requests or 4, vocab=vocab, seed=opts.seed,
                           max_model_len=max_len).capped(128, max_len // 4),
        workloads.alpaca(opts.num_requests or 8, vocab=vocab, seed=opts.seed,
                         max_model_len=max_len),
    ]


def run(opts: BenchOptions) -> tuple[BenchResult, PlotFn]:
    t0 = time.perf_counter()
    widths = (2,) if opts.quick else (2, 4, 6)
    dtype = opts.dtypes[0]
    llm = make_llm(opts.model, overrides=opts.engine_overrides, dtype=dtype,
                   max_model_len=512 if opts.model else 2048)
    rows = []
    for wl in traces(opts):
        for mode in ("parallel", "beam"):
            for k in widths:
                r = run_workload(
                    llm, wl, n=k if mode == "parallel" else 1,
                    beam_width=k if mode == "beam" else 0, seed=opts.seed,
                    tag=f"{wl.name}-{mode}{k}-",
                    sample=lambda s: {"saved": s["kv_blocks_saved_by_sharing"],
                                      "used": s["kv_blocks_used"]})
                steps = [s for s in r.samples if s["used"] + s["saved"] > 0]
                per_step = [s["saved"] / (s["used"] + s["saved"]) for s in steps]
                tot_saved = sum(s["saved"] for s in steps)
                tot = sum(s["used"] + s["saved"] for s in steps)
                rows.append({
                    "trace": wl.name, "mode": mode, "width": k, "steps": r.steps,
                    "mean_saving": sum(per_step) / max(len(per_step), 1),
                    "saving_of_block_steps": tot_saved / max(tot, 1),
                    "peak_used": max((s["used"] for s in steps), default=0),
                    "peak_without_sharing": max((s["used"] + s["saved"] for s in steps),
                                                default=0),
                    "elapsed_s": r.elapsed_s, "paper": PAPER[(mode, wl.name)],
                })
    md = [
        f"{opts.model or 'SmolLM2-135M-Instruct'} {dtype}, block size 16; parallel sampling at "
        "temperature 1 (seeded), beam search with ignore_eos; traces: "
        + "; ".join(str(w.describe()) for w in traces(opts)),
        "",
        md_table(["trace", "mode", "n / beams", "steps", "mean saving per step",
                  "saved block-steps", "peak blocks used", "peak without sharing",
                  "paper (Fig. 15)"],
                 [[r["trace"], r["mode"], r["width"], r["steps"],
                   f"{100 * r['mean_saving']:.1f}%", f"{100 * r['saving_of_block_steps']:.1f}%",
                   r["peak_used"], r["peak_without_sharing"], r["paper"]] for r in rows]),
    ]
    res = BenchResult("sharing", opts.command,
                      {"traces": [w.describe() for w in traces(opts)], "widths": widths,
                       "dtype": dtype, "block_size": 16}, rows, "\n".join(md),
                      elapsed_s=time.perf_counter() - t0)
    return res, plot


def plot(rows: list[dict], fig: Figure) -> None:
    names = list(dict.fromkeys(r["trace"] for r in rows))
    for i, name in enumerate(names):
        ax = fig.add_subplot(1, len(names), i + 1)
        for mode, color in (("parallel", "#4c72b0"), ("beam", "#dd8452")):
            sub = [r for r in rows if r["trace"] == name and r["mode"] == mode]
            ax.plot([r["width"] for r in sub], [100 * r["mean_saving"] for r in sub], "o-",
                    color=color, label=f"{mode} (octavo)")
            lo, hi = (float(x) for x in PAPER[(mode, name)].rstrip("%").split("-"))
            ax.axhspan(lo, hi, color=color, alpha=0.15, label=f"{mode} (vLLM paper)")
        ax.set_xticks(sorted({r["width"] for r in rows}))
        ax.set_xlabel("parallel samples n / beam width")
        ax.set_ylabel("KV memory saved by sharing (%)")
        ax.set_title(name)
        ax.set_ylim(0, 80)
        ax.legend(fontsize=7)
