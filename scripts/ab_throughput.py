"""A/B throughput of two octavo checkouts on the same machine, in one run.

    .venv/bin/python scripts/ab_throughput.py --before /tmp/octavo-before --after . \
        [--dtype float32 --dtype bfloat16] [--repeats 3] [--threads 1]

One worker interpreter per checkout, with PYTHONPATH set to it (so each imports its own octavo),
loads the embedded model once and warms up; then the workers take turns, one timed run each,
of `octavo bench throughput`'s full `mixed` workload (32 requests, prompts 32-512, 64 output
tokens, paged KV, the benchmark's KV budget) through `octavo.bench.engine_run`. Alternating
runs spread the machine's load over both; the medians and their ratio are printed, with the
CPU and its flags, and the time each run spent outside the model's forward pass (the engine's
own overhead: scheduling, plan building, sampling bookkeeping, outputs).
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
model = llm.engine.runner.model
forward, in_model = model.forward, [0.0]
def timed_forward(*a, **k):
    t = time.perf_counter()
    out = forward(*a, **k)
    in_model[0] += time.perf_counter() - t
    return out
model.forward = timed_forward
warm = workloads.Workload("warmup", wl.requests[:2], wl.max_model_len).capped(2)
run_workload(llm, warm, tag="w-")
print("ready", flush=True)
for i, _ in enumerate(sys.stdin):
    in_model[0] = 0.0
    r = run_workload(llm, wl, tag=f"r{i}-")
    assert r.output_tokens == wl.output_tokens
    print(json.dumps({"elapsed_s": r.elapsed_s, "outside_model_s": r.elapsed_s - in_model[0]}),
          flush=True)
"""


def cpu_flags() -> dict[str, object]:
    text = Path("/proc/cpuinfo").read_text()
    model = next((ln.split(":", 1)[1].strip() for ln in text.splitlines()
                  if ln.startswith("model name")), "?")
    flags = set(next((ln.split(":", 1)[1].split() for ln in text.splitlines()
                      if ln.startswith("flags")), []))
    wanted = ["avx2", "avx512f", "avx512_bf16", "amx_bf16"]
    return {"cpu": model, "flags": [f for f in wanted if f in flags]}


class Worker:
    def __init__(self, tree: Path, dtype: str, threads: int) -> None:
        env = {**os.environ, "PYTHONPATH": str(tree.resolve()), "OMP_NUM_THREADS": str(threads),
               "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        self.tree = tree
        self.proc = subprocess.Popen([sys.executable, "-c", RUN_ONE, dtype, str(threads)],
                                     env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True)
        self._expect("ready")

    def _expect(self, what: str) -> str:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the worker for {self.tree} died")
        if what and line.strip() != what:
            raise RuntimeError(f"{self.tree}: expected {what!r}, got {line!r}")
        return line

    def run(self) -> dict[str, float]:
        assert self.proc.stdin is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        return json.loads(self._expect(""))

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(60)


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
        workers = {name: Worker(getattr(args, name), dtype, args.threads)
                   for name in ("before", "after")}
        runs: dict[str, list[dict[str, float]]] = {"before": [], "after": []}
        try:
            for _ in range(args.repeats):
                for name, worker in workers.items():
                    runs[name].append(worker.run())
        finally:
            for worker in workers.values():
                worker.close()
        med = {k: statistics.median(r["elapsed_s"] for r in v) for k, v in runs.items()}
        outside = {k: statistics.median(r["outside_model_s"] for r in v)
                   for k, v in runs.items()}
        out_tokens = 32 * 64
        print(json.dumps({
            "dtype": dtype, "threads": args.threads,
            "times_s": {k: [round(r["elapsed_s"], 3) for r in v] for k, v in runs.items()},
            "median_s": med, "output_tok_s": {k: out_tokens / v for k, v in med.items()},
            "median_outside_model_s": outside,
            "after_over_before_throughput": med["before"] / med["after"],
        }))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
