"""`octavo bench throughput`'s paged engine on `mixed`, two source trees of octavo against each
other in one run: each repeat starts one process per tree (order alternating, so a machine
whose speed drifts favours neither) that builds the engine exactly as the benchmark does,
warms it up and times the workload. Output tokens per second, medians of the repeats, and the
ratio B / A.

    python scripts/throughput_ab.py --a /path/to/old/checkout --b . --cache-root /tmp/ab

Each tree gets its own OCTAVO_CACHE under --cache-root (a/ and b/), so neither rebuilds the
other's compiled ops; the first repeat builds them, before its timed part.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

CHILD = r"""
import json, sys, torch
torch.set_num_threads(int(sys.argv[1]))
from octavo.bench.options import BenchOptions
from octavo.bench.throughput import OctavoEngine, bench_workloads
from octavo.bench import workloads
opts = BenchOptions(threads=int(sys.argv[1]), workloads=["mixed"])
wl = bench_workloads(opts)[0]
eng = OctavoEngine(opts, "float32", "paged")
eng.run(workloads.Workload("warmup", wl.requests[:2], wl.max_model_len).capped(2))
r = eng.run(wl)
print("RESULT " + json.dumps({**r, "out_tok_s": r["output_tokens"] / r["elapsed_s"],
                              "kernel_path": eng.llm.engine.runner.kernel_path()}, default=str))
"""


def run_tree(tree: Path, threads: int, cache: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": str(threads),
           "OCTAVO_CACHE": str(cache)}
    done = subprocess.run([sys.executable, "-c", CHILD, str(threads)], cwd=tree, env=env,
                          capture_output=True, text=True, timeout=3600)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"{tree}: exit {done.returncode}\n{done.stderr[-3000:]}")
    return json.loads(lines[-1].removeprefix("RESULT "))


def git_head(tree: Path) -> str:
    return subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True).stdout.strip()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--a", type=Path, required=True, help="the baseline tree")
    ap.add_argument("--b", type=Path, required=True, help="the tree compared with it")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--cache-root", type=Path, required=True,
                    help="each tree's OCTAVO_CACHE is a/ or b/ under it")
    ap.add_argument("--out", type=Path, help="write the result JSON here")
    args = ap.parse_args()
    trees = {"a": args.a.resolve(), "b": args.b.resolve()}
    runs: dict[str, list[dict]] = {"a": [], "b": []}
    for rep in range(args.repeats):
        for name in ("a", "b") if rep % 2 == 0 else ("b", "a"):
            r = run_tree(trees[name], args.threads, args.cache_root / name)
            runs[name].append(r)
            print(f"repeat {rep} {name} ({git_head(trees[name])}): "
                  f"{r['out_tok_s']:.2f} out tok/s", flush=True)
    med = {k: statistics.median(r["out_tok_s"] for r in v) for k, v in runs.items()}
    flags = sorted({f for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("flags") for f in line.split(":")[1].split()}
                   & {"avx2", "avx512f", "avx512_bf16", "amx_bf16", "avx512_vnni"})
    result = {"a": {"tree": str(trees["a"]), "commit": git_head(trees["a"]), "runs": runs["a"],
                    "median_out_tok_s": med["a"]},
              "b": {"tree": str(trees["b"]), "commit": git_head(trees["b"]), "runs": runs["b"],
                    "median_out_tok_s": med["b"]},
              "ratio_b_over_a": med["b"] / med["a"], "threads": args.threads,
              "repeats": args.repeats, "cpu": platform.processor() or platform.machine(),
              "cpu_flags": flags, "workload": "mixed (octavo bench throughput's full run)"}
    print(f"median out tok/s: a {med['a']:.2f}, b {med['b']:.2f}; b / a = "
          f"{med['b'] / med['a']:.3f}")
    if args.out:
        args.out.write_text(json.dumps(result, indent=1, default=str) + "\n")


if __name__ == "__main__":
    main()
