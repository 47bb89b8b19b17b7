"""What paging costs the scheduler: KV manager CPU time per decode step.

256 running sequences with ~200-token prompts decode together; each step the scheduler asks the
manager for one more slot per sequence (can_append_slots + append_slots, which also hashes every
block that fills) and reads every block table for the runner. Block sizes 1, 16 and 128 show the
per-block costs; the same runs with 2x and 4x the pool show that nothing scales with the number
of blocks. Prefix caching is on, as by default.

    python -m octavo.bench.paging_overhead [--out bench_results/paging_overhead.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import time
from pathlib import Path

from octavo.paging import KVCacheManager

BLOCK_SIZES = (1, 16, 128)
POOL_SCALES = (1, 2, 4)


def measure_once(
    *, block_size: int, pool_scale: int, num_seqs: int, prompt_len: int, steps: int, seed: int
) -> dict[str, float]:
    rng = random.Random(seed)
    prompts = [
        [rng.randrange(32000) for _ in range(rng.randint(prompt_len - 20, prompt_len + 20))]
        for _ in range(num_seqs)
    ]
    blocks_needed = sum(-(-(len(p) + steps) // block_size) for p in prompts)
    mgr = KVCacheManager(blocks_needed * pool_scale, block_size)
    for seq_id, prompt in enumerate(prompts):
        cached = mgr.find_cached_prefix(prompt)  # at block size 1 random prompts do share
        mgr.allocate(seq_id, prompt, len(prompt) - cached)
    sampled = [[rng.randrange(32000) for _ in range(num_seqs)] for _ in range(steps)]
    append_ns: list[int] = []
    table_ns: list[int] = []
    gc.collect()
    for step in range(steps):
        for seq_id, prompt in enumerate(prompts):  # the engine's part, not timed
            prompt.append(sampled[step][seq_id])
        t0 = time.perf_counter_ns()
        for seq_id, tokens in enumerate(prompts):
            if not mgr.can_append_slots(seq_id, 1):
                raise RuntimeError("pool sized too small for the benchmark")
            mgr.append_slots(seq_id, tokens, 1)
        t1 = time.perf_counter_ns()
        for seq_id in range(num_seqs):
            mgr.block_table(seq_id)
        t2 = time.perf_counter_ns()
        append_ns.append(t1 - t0)
        table_ns.append(t2 - t1)
    mgr.check_invariants()
    return {
        "num_blocks": mgr.num_blocks,
        "append_us_per_step": statistics.median(append_ns) / 1e3,
        "block_table_us_per_step": statistics.median(table_ns) / 1e3,
    }


def run(
    *,
    num_seqs: int,
    prompt_len: int,
    steps: int,
    repeats: int,
    block_sizes=BLOCK_SIZES,
    pool_scales=POOL_SCALES,
) -> list[dict[str, float]]:
    rows = []
    for block_size in block_sizes:
        for pool_scale in pool_scales:
            runs = [
                measure_once(
                    block_size=block_size,
                    pool_scale=pool_scale,
                    num_seqs=num_seqs,
                    prompt_len=prompt_len,
                    steps=steps,
                    seed=r,
                )
                for r in range(repeats)
            ]
            append = statistics.median(r["append_us_per_step"] for r in runs)
            table = statistics.median(r["block_table_us_per_step"] for r in runs)
            rows.append(
                {
                    "block_size": block_size,
                    "pool_scale": pool_scale,
                    "num_blocks": runs[0]["num_blocks"],
                    "append_us_per_step": round(append, 1),
                    "block_table_us_per_step": round(table, 1),
                    "total_us_per_step": round(append + table, 1),
                    "total_us_per_seq": round((append + table) / num_seqs, 3),
                }
            )
    return rows


def format_table(rows: list[dict[str, float]]) -> str:
    head = (
        "block_size",
        "pool",
        "num_blocks",
        "append us/step",
        "tables us/step",
        "total us/step",
        "us/seq",
    )
    lines = ["  ".join(f"{h:>14}" for h in head)]
    for r in rows:
        cells = (
            r["block_size"],
            f"{r['pool_scale']}x",
            r["num_blocks"],
            r["append_us_per_step"],
            r["block_table_us_per_step"],
            r["total_us_per_step"],
            r["total_us_per_seq"],
        )
        lines.append("  ".join(f"{c:>14}" for c in cells))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench_results/paging_overhead.json")
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=200)
    parser.add_argument("--steps", type=int, default=128, help="decode steps per repeat")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    config = {k: getattr(args, k) for k in ("num_seqs", "prompt_len", "steps", "repeats")}
    rows = run(**config)
    print(
        f"KV manager CPU time per decode step ({args.num_seqs} sequences, prompts "
        f"~{args.prompt_len} tokens, median of {args.repeats} repeats x {args.steps} steps)"
    )
    print(format_table(rows))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps({"benchmark": "paging_overhead", "config": config, "results": rows}, indent=2)
        + "\n"
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
