"""A/B throughput of two octavo checkouts on the same machine, in one run.

    .venv/bin/python scripts/ab_throughput.py --before /tmp/octavo-before --after . \
        [--dtype float32 --dtype bfloat16] [--repeats 3] [--threads 1]

Each timed run is a fresh interpreter with PYTHONPATH set to one checkout (so each imports its
own octavo), which loads the embedded model, warms up, then times `octavo bench throughput`'s
full `mixed` workload (32 requests, prompts 32-512, 64 output tokens, paged KV, the benchmark's
KV budget) through `octavo.bench.engine_run`. Repeats alternate before/after so machine load
lands on both; the medians and their ratio are printed, with the CPU and its flags.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

RUN_ONE = r"""
import json, sys, time, torch
torch.set_num_threads(int(sys.argv[2]))
from octavo.bench import workloads
from octavo.bench.concurrency import kv_bytes_per_token
from octavo.bench.engine_run import make_llm, run_workload
from octavo.bench.waste import KV_TOKENS
dtype = sys.argv[1]
wl = workloads.mixed(32, output_len=64, max_prompt=512, vocab=workloads.SMOLLM2_VOCAB, seed=0)
llm = make_llm(None, dtype=dtype, allocator="paged", block_size=16,
               kv_cache_memory_bytes=KV_TOKENS * kv_bytes_per_token(None, dtype),
               max_model_len=2048)
warm = workloads.Workload("warmup", wl.requests[:2], wl.max_model_len).capped(2)
run_workload(llm, warm, tag="w-")
r = run_workload(llm, wl, tag="r-")
assert r.output_tokens == wl.output_tokens
print(json.dumps({"elapsed_s": r.elapsed_s, "output_tokens": r.output_tokens}))
"""


def cpu_flags() -> dict[str, object]:
    text = Path("/proc/cpuinfo").read_text()
    model = next((ln.split(":", 1)[1].strip() for ln in text.splitlines()
                  if ln.startswith("model name")), "?")
    flags = set(next((ln.split(":", 1)[1].split() for ln in text.splitlines()
                      if ln.startswith("flags")), []))
    wanted = ["avx2", "avx512f", "avx512_bf16", "amx_bf16"]
    return {"cpu": model, "flags": [f for f in wanted if f in flags]}


def timed(tree: Path, dtype: str, threads: int) -> float:
    env = {**os.environ, "PYTHONPATH": str(tree.resolve()), "OMP_NUM_THREADS": str(threads),
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-c", RUN_ONE, dtype, str(threads)], env=env,
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{tree}: {done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])["elapsed_s"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before", type=Path, required=True)
    p.add_argument("--after", type=Path, default=Path("."))
    p.add_argument("--dtype", action="append", default=None)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    print(json.dumps(cpu_flags()))
    for dtype in args.dtype or ["float32"]:
        times: dict[str, list[float]] = {"before": [], "after": []}
        for _ in range(args.repeats):
            for name in ("before", "after"):
                times[name].append(timed(getattr(args, name), dtype, args.threads))
        med = {k: statistics.median(v) for k, v in times.items()}
        out_tokens = 32 * 64
        print(json.dumps({
            "dtype": dtype, "threads": args.threads, "times_s": times,
            "median_s": med, "output_tok_s": {k: out_tokens / v for k, v in med.items()},
            "after_over_before_throughput": med["before"] / med["after"],
        }))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
