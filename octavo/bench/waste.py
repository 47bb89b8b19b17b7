"""Where KV memory goes: live tokens versus internal, reservation and external waste.

Model-free: the engine's scheduler replays the traces through octavo's own allocators with no
model (sim.py), so admission, preemption and the accounting are exactly the engine's (waste.py /
WasteTracker). Compared: one
contiguous buffer reserved for max_model_len (Orca-Max / FasterTransformer style), one reserved
for prompt + max_tokens (an oracle-ish Orca that knows max_tokens), and paging at block sizes
1-256. The headline is the share of *occupied* KV memory (everything but usable free slots)
that holds live tokens, averaged over the replay weighted by occupancy: the quantity of the
vLLM paper's Fig. 2. The sliding-window rows replay the same traces for a Mistral-style model
whose every layer attends to the last WINDOW tokens: paging frees the blocks that leave the
window, so a sequence never holds more than WINDOW / block_size + 1 blocks; its slots that left
the window but share a block with ones still inside count as internal waste.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict

from matplotlib.figure import Figure

from octavo.bench import workloads
from octavo.bench.common import BenchResult, PlotFn, md_table
from octavo.bench.options import BenchOptions
from octavo.bench.sim import simulate

BLOCK_SIZES = (1, 8, 16, 32, 64, 128, 256)
KV_TOKENS = 23296  # the engine's default 1 GiB CPU KV cache for SmolLM2-135M in fp32
WINDOW = 512  # tokens: shorter than most of a trace's long sequences, so it cuts
SHARES = ("live", "reserved", "internal", "external")
COLORS = {"live": "#4c72b0", "reserved": "#dd8452", "internal": "#c44e52",
          "external": "#8c8c8c"}


def configs() -> list[tuple[str, int, int | None]]:
    """(allocator, block size, sliding window)."""
    return [("contiguous-max", 1, None), ("contiguous-request", 1, None)] + [
        ("paged", bs, None) for bs in BLOCK_SIZES
    ] + [("paged", 16, WINDOW)]


def label(kind: str, bs: int, window: int | None = None) -> str:
    if window is not None:
        return f"paged bs={bs} window={window}"
    return {"contiguous-max": "contig max_len", "contiguous-request": "contig request"}.get(
        kind, f"paged bs={bs}"
    )


def traces(opts: BenchOptions) -> list[workloads.Workload]:
    n = opts.num_requests or opts.pick(200, 1000)
    return [workloads.sharegpt(n, seed=opts.seed), workloads.case_study(n, seed=opts.seed)]


def run(opts: BenchOptions) -> tuple[BenchResult, PlotFn]:
    t0 = time.perf_counter()
    arrivals = {"burst": math.inf, "poisson": 0.05}  # poisson: requests per decode step
    rows = []
    for wl in traces(opts):
        for arrival, rate in arrivals.items():
            for kind, bs, window in configs():
                r = simulate(wl, kind, kv_tokens=KV_TOKENS, block_size=bs, arrival_rate=rate,
                             seed=opts.seed, window=window)
                d = asdict(r)
                d.pop("running_series")
                rows.append({"trace": wl.name, "arrival": arrival, **d})
    md = [
        f"KV budget {KV_TOKENS} token slots; traces: "
        + "; ".join(str(wl.describe()) for wl in traces(opts)),
        "",
        "Share of occupied KV memory (%, occupancy-weighted mean over the replay); "
        "peak = highest share of *all* KV memory seen at any step. Poisson arrivals: 0.05 "
        "requests per decode step, which overloads the contiguous allocators but not paging "
        "(running (queue non-empty) is 0 when no request ever waited).",
        "",
    ]
    table = []
    for r in rows:
        used, tot = r["waste_of_used"], r["waste_of_total"]
        table.append([
            r["trace"], r["arrival"], label(r["allocator"], r["block_size"], r["window"]),
            100 * used["live"]["mean"], 100 * (1 - used["live"]["mean"]),
            100 * used["internal"]["mean"], 100 * used["reserved"]["mean"],
            100 * used["external"]["mean"], 100 * tot["internal"]["peak"],
            100 * tot["reserved"]["peak"], 100 * tot["external"]["peak"],
            r["mean_running"], r["loaded_running"], r["preemptions"], r["max_seq_slots"],
        ])
    md.append(md_table(
        ["trace", "arrivals", "allocator", "live %", "waste %", "internal %", "reserved %",
         "external %", "peak internal %", "peak reserved %", "peak external %",
         "running (mean)", "running (queue non-empty)", "preemptions", "max slots / seq"],
        table, digits=1))
    paged16 = [r for r in rows if r["allocator"] == "paged" and r["block_size"] == 16
               and r["window"] is None]
    worst = max(100 * (1 - r["waste_of_used"]["live"]["mean"]) for r in paged16)
    md += ["", f"Goal: paged at block size 16 wastes < 4% of occupied KV memory: worst case "
           f"{worst:.2f}% -> {'met' if worst < 4 else 'NOT met'}."]
    sliding = [r for r in rows if r["window"] is not None]
    bound = (WINDOW // 16 + 1) * 16
    held = max(r["max_seq_slots"] for r in sliding)
    md += ["", f"Sliding window {WINDOW}: the most KV slots one sequence held is {held} "
           f"(bound (window / block size + 1) x block size = {bound}) -> "
           f"{'bounded' if held <= bound else 'NOT bounded'}; without the window, "
           f"{max(r['max_seq_slots'] for r in paged16)}."]
    config = {"kv_tokens": KV_TOKENS, "block_sizes": BLOCK_SIZES, "arrivals": arrivals,
              "window": WINDOW,
              "traces": [wl.describe() for wl in traces(opts)]}
    res = BenchResult("waste", opts.command, config, rows, "\n".join(md),
                      elapsed_s=time.perf_counter() - t0)
    return res, plot


def plot(rows: list[dict], fig: Figure) -> None:
    """Fig. 2 of the vLLM paper: stacked shares of occupied KV memory per allocator."""
    burst = [r for r in rows if r["arrival"] == "burst"]
    names = list(dict.fromkeys(r["trace"] for r in burst))
    for i, name in enumerate(names):
        ax = fig.add_subplot(1, len(names), i + 1)
        sub = [r for r in burst if r["trace"] == name]
        labels = [label(r["allocator"], r["block_size"], r.get("window")) for r in sub]
        bottom = [0.0] * len(sub)
        for share in SHARES:
            vals = [100 * r["waste_of_used"][share]["mean"] for r in sub]
            ax.bar(labels, vals, bottom=bottom, color=COLORS[share], label=share)
            bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
        for x, r in enumerate(sub):
            live = 100 * r["waste_of_used"]["live"]["mean"]
            ax.text(x, min(live, 92) + 2, f"{live:.0f}%", ha="center", fontsize=7)
        ax.set_title(f"{name} (all requests at once)")
        ax.set_ylabel("% of occupied KV memory")
        ax.set_ylim(0, 100)
        ax.tick_params(axis="x", rotation=60, labelsize=8)
    fig.axes[0].legend(loc="lower right", fontsize=8)
