"""What paging costs the scheduler: KV manager CPU time per decode step (`octavo bench paging`).

256 running sequences with ~200-token prompts decode together; each step the scheduler asks the
manager for one more slot per sequence (one allocate_slots each, which also registers every
block that fills in the prefix cache) and reads every block table. Block sizes 1, 16 and 128
show the per-block costs; the same runs with 2x and 4x the pool show that nothing scales with
the number of blocks. Prefix caching is on, as by default. No model: pure Python.
"""

from __future__ import annotations

import gc
import random
import statistics
import time

from matplotlib.figure import Figure

from octavo.bench.common import BenchResult, PlotFn, md_table
from octavo.bench.options import BenchOptions
from octavo.paging import BlockHasher, KVCacheManager, KVSeq

BLOCK_SIZES = (1, 16, 128)
POOL_SCALES = (1, 2, 4)


def measure_once(
    *, block_size: int, pool_scale: int, num_seqs: int, prompt_len: int, steps: int, seed: int
) -> dict[str, float]:
    rng = random.Random(seed)
    hasher = BlockHasher(block_size)
    seqs = [
        KVSeq(i, [rng.randrange(32000) for _ in range(rng.randint(prompt_len - 20,
                                                                    prompt_len + 20))],
              hasher=hasher)
        for i in range(num_seqs)
    ]
    blocks_needed = sum(-(-(len(s.token_ids) + steps) // block_size) for s in seqs)
    mgr = KVCacheManager(blocks_needed * pool_scale, block_size)
    for seq in seqs:
        cached = mgr.get_computed_blocks(seq)  # at block size 1 random prompts do share
        if mgr.allocate_slots(seq, len(seq.token_ids) - cached.num_tokens, cached) is None:
            raise RuntimeError("pool sized too small for the benchmark")
    sampled = [[rng.randrange(32000) for _ in range(num_seqs)] for _ in range(steps)]
    append_ns: list[int] = []
    table_ns: list[int] = []
    gc.collect()
    for step in range(steps):
        for seq in seqs:  # the engine's part (hashing a block when it fills), not timed
            seq.append_token(sampled[step][seq.seq_id])
        t0 = time.perf_counter_ns()
        for seq in seqs:
            if mgr.allocate_slots(seq, 1) is None:
                raise RuntimeError("pool sized too small for the benchmark")
        t1 = time.perf_counter_ns()
        for seq in seqs:
            mgr.block_table(seq.seq_id)
        t2 = time.perf_counter_ns()
        append_ns.append(t1 - t0)
        table_ns.append(t2 - t1)
    mgr.check_invariants()
    return {
        "num_blocks": mgr.num_blocks,
        "append_us_per_step": statistics.median(append_ns) / 1e3,
        "block_table_us_per_step": statistics.median(table_ns) / 1e3,
    }


def run(opts: BenchOptions) -> tuple[BenchResult, PlotFn]:
    t0 = time.perf_counter()
    config = {"num_seqs": opts.pick(64, 256), "prompt_len": 200, "steps": opts.pick(16, 128),
              "repeats": opts.reps(1, 5)}
    rows = []
    for block_size in BLOCK_SIZES:
        for pool_scale in POOL_SCALES:
            runs = [
                measure_once(block_size=block_size, pool_scale=pool_scale,
                             num_seqs=config["num_seqs"], prompt_len=config["prompt_len"],
                             steps=config["steps"], seed=opts.seed + r)
                for r in range(config["repeats"])
            ]
            append = statistics.median(r["append_us_per_step"] for r in runs)
            table = statistics.median(r["block_table_us_per_step"] for r in runs)
            rows.append({
                "block_size": block_size,
                "pool_scale": pool_scale,
                "num_blocks": runs[0]["num_blocks"],
                "append_us_per_step": round(append, 1),
                "block_table_us_per_step": round(table, 1),
                "total_us_per_step": round(append + table, 1),
                "total_us_per_seq": round((append + table) / config["num_seqs"], 3),
            })
    md = [
        f"KV manager CPU time per decode step: {config['num_seqs']} sequences, prompts "
        f"~{config['prompt_len']} tokens, median of {config['repeats']} repeats x "
        f"{config['steps']} steps.",
        "",
        md_table(["block size", "pool", "blocks", "allocate_slots us/step",
                  "block tables us/step", "total us/step", "us/seq"],
                 [[r["block_size"], f"{r['pool_scale']}x", r["num_blocks"],
                   r["append_us_per_step"], r["block_table_us_per_step"],
                   r["total_us_per_step"], r["total_us_per_seq"]] for r in rows], digits=1),
    ]
    res = BenchResult("paging", opts.command, config, rows, "\n".join(md),
                      elapsed_s=time.perf_counter() - t0)
    return res, plot


def plot(rows: list[dict], fig: Figure) -> None:
    ax = fig.add_subplot(1, 1, 1)
    for scale in POOL_SCALES:
        sub = [r for r in rows if r["pool_scale"] == scale]
        ax.plot([r["block_size"] for r in sub], [r["total_us_per_seq"] for r in sub],
                marker="o", label=f"pool {scale}x")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("block size (tokens)")
    ax.set_ylabel("KV manager time per sequence per decode step (us)")
    ax.set_title("Paging bookkeeping per decode step")
    ax.legend()
