"""`octavo bench gpu`: the Triton backend on a CUDA GPU (scripts/gpu_check.sh runs it).

1. Decode attention, the paper's comparison: octavo's paged decode kernel (split-K, K/V read
   through shuffled block tables) against a contiguous FlashAttention-style baseline (torch's
   SDPA over [B, kv_heads, L, head_dim] K/V, the same GQA shape), at batch 64 x 1k context and
   a few other points, bf16, timed with CUDA events (median of repeats after warm-up). The
   vLLM paper reports a 20-26% overhead for paging; the goal is <= 1.25x.
2. Offline throughput on `mixed` with the engine's GPU defaults (Triton kernels, CUDA graphs
   for decode), then with enforce_eager, then with the plain-torch backend (gather + SDPA).

It needs a CUDA device and says so otherwise.
"""

from __future__ import annotations

import gc
from typing import Any

import torch
from matplotlib.figure import Figure

from octavo.bench.common import BenchResult, md_table, median, timed_repeats
from octavo.bench.engine_run import make_llm, run_workload
from octavo.bench.options import BenchOptions
from octavo.bench.workloads import mixed

# (batch, context, heads, kv_heads, head_dim): the paper's point at a 7B-like shape first
DECODE_POINTS = [(64, 1024, 32, 8, 128), (64, 1024, 9, 3, 64), (8, 4096, 32, 8, 128),
                 (1, 16384, 32, 8, 128), (256, 512, 32, 8, 128)]
BLOCK_SIZE = 16


def cuda_ms(fn, repeats: int = 50, warmup: int = 5) -> float:
    """Median milliseconds of one call, timed with CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return median(times)


def wall_ms(fn, repeats: int = 3) -> float:
    """Median milliseconds of one call by the wall clock (the interpreter's CPU runs)."""
    return 1000 * median(timed_repeats(fn, repeats)[0])


def decode_point(batch: int, context: int, heads: int, kv_heads: int, dim: int,
                 dtype: torch.dtype = torch.bfloat16, device: str = "cuda") -> dict[str, Any]:
    """One decode-attention comparison (on CPU, in Triton's interpreter: the tests' check of
    this code, not a timing)."""
    from octavo.model.kernels.triton import triton_missing

    dev = torch.device(device)
    problem = triton_missing(dev.type)
    if problem is not None:
        raise RuntimeError(problem)
    from octavo.model.kernels.triton.decode import num_splits, paged_decode

    timer = cuda_ms if dev.type == "cuda" else wall_ms
    gen = torch.Generator(device=dev).manual_seed(0)
    per_seq = -(-context // BLOCK_SIZE)
    blocks = batch * per_seq
    k_cache = torch.randn(blocks, BLOCK_SIZE, kv_heads, dim, device=dev, dtype=dtype,
                          generator=gen)
    v_cache = torch.randn_like(k_cache)
    tables = torch.randperm(blocks, device=dev, generator=gen).view(batch, per_seq)
    lens = torch.full((batch,), context, device=dev, dtype=torch.long)
    q = torch.randn(batch, heads, dim, device=dev, dtype=dtype, generator=gen)
    scale = dim**-0.5
    # the contiguous baseline holds the same keys, laid out per sequence
    k = k_cache[tables].flatten(1, 2)[:, :context].transpose(1, 2).contiguous()
    v = v_cache[tables].flatten(1, 2)[:, :context].transpose(1, 2).contiguous()
    out = torch.empty_like(q)

    def paged() -> None:
        paged_decode(q, k_cache, v_cache, tables, lens, scale, out=out)

    def contiguous() -> torch.Tensor:
        return torch.nn.functional.scaled_dot_product_attention(
            q[:, :, None], k, v, scale=scale, enable_gqa=True)

    paged()
    ref = contiguous()[:, :, 0]
    err = (out.float() - ref.float()).abs().max().item()
    paged_ms, contiguous_ms = timer(paged), timer(contiguous)
    kv_bytes = 2 * batch * context * kv_heads * dim * k_cache.element_size()
    return {"batch": batch, "context": context, "heads": heads, "kv_heads": kv_heads,
            "head_dim": dim, "splits": num_splits(per_seq * BLOCK_SIZE),
            "paged_ms": paged_ms, "contiguous_ms": contiguous_ms,
            "ratio": paged_ms / contiguous_ms, "max_abs_err": err,
            "paged_tb_s": kv_bytes / paged_ms / 1e9}


def run(opts: BenchOptions) -> tuple[BenchResult, Any]:
    if not torch.cuda.is_available():
        raise SystemExit("octavo bench gpu needs a CUDA device (none is visible here)")
    decode = [decode_point(*p) for p in DECODE_POINTS]  # milliseconds each, quick or not
    wl = mixed(opts.pick(16, 64), output_len=opts.pick(32, 128), seed=opts.seed)
    repeats = opts.reps(1, 3)
    engines = {"triton + CUDA graphs": {},
               "triton, eager": {"enforce_eager": True},
               "torch backend, eager": {"enforce_eager": True, "attention_backend": "torch",
                                        "fused_ops": "torch"}}
    throughput: dict[str, Any] = {}
    for name, extra in engines.items():
        llm = make_llm(opts.model, dtype=opts.dtypes[0], device="cuda",
                       overrides=opts.engine_overrides, **extra)
        try:
            run_workload(llm, wl, tag="warm-")
            runs = [run_workload(llm, wl, tag=f"r{i}-") for i in range(repeats)]
            throughput[name] = {"output_tok_s": median([r.output_tok_s for r in runs]),
                                "runs_tok_s": [round(r.output_tok_s, 1) for r in runs],
                                "kernel_path": llm.engine.kernel_path()}
        finally:
            llm.shutdown()
            del llm
            gc.collect()
            torch.cuda.empty_cache()
    rows = [[f"{d['batch']} x {d['context']}", f"{d['heads']}/{d['kv_heads']}x{d['head_dim']}",
             d["splits"], d["paged_ms"] * 1000, d["contiguous_ms"] * 1000, d["ratio"],
             d["paged_tb_s"], d["max_abs_err"]] for d in decode]
    markdown = md_table(["batch x context", "heads/kv x dim", "splits", "paged us",
                         "contiguous SDPA us", "paged / contiguous", "paged TB/s",
                         "max abs err"], rows)
    base = throughput["torch backend, eager"]["output_tok_s"]
    markdown += "\n\n" + md_table(
        ["engine", f"mixed output tok/s ({len(wl.requests)} requests)", "x torch backend",
         "runs"],
        [[n, t["output_tok_s"], t["output_tok_s"] / base, " ".join(map(str, t["runs_tok_s"]))]
         for n, t in throughput.items()])
    config = {"block_size": BLOCK_SIZE, "decode_dtype": "bfloat16", "repeats": repeats,
              "engine_dtype": opts.dtypes[0], "workload": wl.describe()}
    return BenchResult("gpu", opts.command, config, {"decode": decode,
                                                      "throughput": throughput},
                       markdown), plot


def plot(results: dict[str, Any], fig: Figure) -> None:
    ax1, ax2 = fig.subplots(1, 2)
    decode = results["decode"]
    labels = [f"{d['batch']}x{d['context']}\n{d['heads']}/{d['kv_heads']}" for d in decode]
    ax1.bar(range(len(decode)), [d["ratio"] for d in decode])
    ax1.axhline(1.25, color="red", linestyle="--", label="goal 1.25x")
    ax1.set_xticks(range(len(decode)), labels, fontsize=7)
    ax1.set_ylabel("paged / contiguous time")
    ax1.set_title("decode attention")
    ax1.legend()
    names = list(results["throughput"])
    ax2.bar(range(len(names)), [results["throughput"][n]["output_tok_s"] for n in names])
    ax2.set_xticks(range(len(names)), names, fontsize=7)
    ax2.set_ylabel("output tokens/s (mixed)")
    ax2.set_title("offline throughput")
