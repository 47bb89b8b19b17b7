"""`octavo bench kquant`: GGUF's K-quant linears (Q4_K, Q5_K, Q6_K) computed in their blocks
(csrc/kquant_linear.cpp), at Qwen2.5-1.5B's layer shapes (hidden 1536, intermediate 8960, vocab
151936, 12 heads and 2 KV heads of 128):

- decode: every linear layer of `layers` decoder layers (qkv, o, gate_up, down) and the LM head,
  one after the other as in a decode step (so the weights come from memory, not the caches), at
  1, 4 and 16 rows, 1 and 2 threads: GB/s of weight bytes read and weight rows/s, against this
  machine's read bandwidth measured here the same way (a streaming sum over a buffer larger than
  the caches). A decode step reads every weight byte once, so that bandwidth is its bound.
  One-thread runs are also timed in the thread's CPU time, which a shared machine's other
  processes do not inflate (the streaming read too).
- the kernel alone: one row through a weight that stays in L2, one thread (GB/s with memory
  out of the way: where it is well above the read bandwidth, decode is memory-bound).
- prefill: 512 rows through one decoder layer's linears, each way a layer could compute them:
  the integer kernel at 512 rows (what BlockQuantLinear runs), tiles widened to fp32 into a
  reused buffer then oneDNN's fp32 GEMM (BlockQuantLinear._tiled, what the 32-weight formats
  run), and torch's and oneDNN's fp32 GEMM on fp32 weights of the same shapes (no widening):
  GFLOP/s (2 M N K per layer).
- prefill of the 32-weight formats (Q8_0, Q5_0) at Gemma 3 270M's shapes (hidden 640: q 1024,
  k 256, v 256, gate_up 4096, the layers its Q4_K_M file holds in them), the same ways: the
  engine's (block_linear's integer tiles: block_tile.h on AVX-512 VNNI, block_tile_avx2.h in
  the AVX2 build; else the widened tiles), the widened tiles + oneDNN, and oneDNN on fp32 weights.

Weights are random valid super-blocks (kquant.random_blocks), repacked as the loader does: the
speed does not depend on the values. Medians of repeats; the first pass of each is a warm-up.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.nn.functional as F
from matplotlib.figure import Figure

from octavo.bench.common import BenchResult, md_table, median
from octavo.bench.options import BenchOptions
from octavo.model.kernels.cpu_ops import load_cpu_ops
from octavo.model.quant import kquant
from octavo.model.quant.block_quant import (
    INT8,
    BlockQuantLinear,
    _gemm,
    dequantize,
    pack_fives,
    quantize_int8_blocks,
)
from octavo.model.quant.gguf_blocks import FORMATS

HIDDEN, INTERMEDIATE, VOCAB, HEADS, KV_HEADS, HEAD_DIM = 1536, 8960, 151936, 12, 2, 128
LAYER_SHAPES = [(HEADS * HEAD_DIM + 2 * KV_HEADS * HEAD_DIM, HIDDEN),  # qkv
                (HIDDEN, HEADS * HEAD_DIM),  # o
                (2 * INTERMEDIATE, HIDDEN),  # gate_up
                (HIDDEN, INTERMEDIATE)]  # down
NAMES = ("Q4_K", "Q5_K", "Q6_K")
DECODE_ROWS = (1, 4, 16)
PREFILL_ROWS = 512
THREADS = (1, 2)
SMALL_SHAPES = [(1024, 640), (256, 640), (256, 640), (4096, 640)]  # Gemma 3 270M q, k, v, gate_up
NAMES_32 = ("Q8_0", "Q5_0")


def _timed(fn, repeats: int) -> tuple[float, float]:
    """Medians of (wall seconds, this thread's CPU seconds) over `repeats` calls after a
    warm-up. With one thread the CPU time leaves out the time the OS gave other processes: on a
    shared machine it is the rate the core itself reached."""
    fn()
    wall, cpu = [], []
    for _ in range(repeats):
        t, c = time.perf_counter(), time.thread_time()
        fn()
        wall.append(time.perf_counter() - t)
        cpu.append(time.thread_time() - c)
    return median(wall), median(cpu)


def read_bandwidth(repeats: int, mib: int = 512) -> tuple[float, float]:
    """GB/s of a streaming read, torch's sum over `mib` MiB of fp32 (past every cache): by wall
    time, and by this thread's CPU time."""
    buf = torch.ones(mib * 2**20 // 4)
    wall, cpu = _timed(buf.sum, repeats)
    return buf.numel() * 4 / wall / 1e9, buf.numel() * 4 / cpu / 1e9


def decode(ops: Any, kind: int, layers: int, repeats: int, gen: torch.Generator) -> list[dict]:
    """One format's decode passes at each row count and thread count."""
    shapes = LAYER_SHAPES * layers + [(VOCAB, HIDDEN)]
    weights = [kquant.repack(kind, kquant.random_blocks(kind, n, k, gen)) for n, k in shapes]
    nbytes = sum(w.numel() for w in weights)
    rows = sum(n for n, _ in shapes)
    out = []
    for threads in THREADS:
        torch.set_num_threads(threads)
        for m in DECODE_ROWS:
            xs = {k: torch.randn(m, k, generator=gen) for k in {k for _, k in shapes}}

            def step(xs=xs) -> None:
                for w, (_, k) in zip(weights, shapes, strict=True):
                    ops.kquant_linear(xs[k], kind, w, None)

            s, cpu = _timed(step, repeats)
            out.append({"threads": threads, "rows": m, "ms": s * 1e3,
                        "weight_gb_s": nbytes / s / 1e9, "weight_rows_s": rows / s,
                        "weight_bytes": nbytes,
                        "cpu_time_weight_gb_s": nbytes / cpu / 1e9 if threads == 1 else None})
    return out


def in_cache(ops: Any, kind: int, repeats: int, gen: torch.Generator) -> dict:
    """GB/s of one row through a weight that stays in L2 (512 x 1536, ~0.3-0.4 MB), one thread:
    the kernel's own rate with memory out of the way. Above the read bandwidth, a decode step
    from memory is bound by the memory, not by the kernel."""
    w = kquant.repack(kind, kquant.random_blocks(kind, 512, HIDDEN, gen))
    x = torch.randn(1, HIDDEN, generator=gen)
    calls = 200
    torch.set_num_threads(1)

    def run() -> None:
        for _ in range(calls):
            ops.kquant_linear(x, kind, w, None)

    s, cpu = _timed(run, repeats)
    return {"weight_gb_s": w.numel() * calls / s / 1e9,
            "cpu_time_weight_gb_s": w.numel() * calls / cpu / 1e9, "weight_bytes": w.numel()}


def _time_ways(ways: dict[str, Any], flops: int, repeats: int) -> list[dict]:
    """Each way at each thread count: ms and GFLOP/s (`flops` per call)."""
    out = []
    with torch.inference_mode():
        for threads in THREADS:
            torch.set_num_threads(threads)
            for way, fn in ways.items():
                s, _ = _timed(fn, repeats)
                out.append({"threads": threads, "way": way, "ms": s * 1e3,
                            "gflop_s": flops / s / 1e9})
    return out


def prefill(ops: Any, name: str, repeats: int, gen: torch.Generator) -> list[dict]:
    """One decoder layer's linears at PREFILL_ROWS rows, each way, at each thread count."""
    fmt = FORMATS[name][0]
    kind = fmt.kind
    weights = [kquant.repack(kind, kquant.random_blocks(kind, n, k, gen))
               for n, k in LAYER_SHAPES]
    blocks = []
    for w in weights:
        layer = BlockQuantLinear(fmt, w, None, None, None)
        layer.ops = ops
        blocks.append(layer)
    fp32 = [kquant.dequantize(kind, w) for w in weights]
    flops = sum(2 * PREFILL_ROWS * n * k for n, k in LAYER_SHAPES)
    xs = [torch.randn(PREFILL_ROWS, k, generator=gen) for _, k in LAYER_SHAPES]
    ways = {
        "int8 kernel (the engine's)":
            lambda: [b(x) for b, x in zip(blocks, xs, strict=True)],
        "widened tiles + oneDNN fp32":
            lambda: [b._tiled(x) for b, x in zip(blocks, xs, strict=True)],
        "torch fp32 GEMM (F.linear)":
            lambda: [F.linear(x, w) for w, x in zip(fp32, xs, strict=True)],
        "oneDNN fp32 GEMM":
            lambda: [_gemm(x, w, None) for w, x in zip(fp32, xs, strict=True)],
    }
    return _time_ways(ways, flops, repeats)


def prefill_32(ops: Any, name: str, repeats: int, gen: torch.Generator) -> list[dict]:
    """The 32-weight format `name` at SMALL_SHAPES and PREFILL_ROWS rows, each way."""
    fmt = FORMATS[name][0]
    layers = []
    for n, k in SMALL_SHAPES:
        if fmt.kind == INT8:
            q, scale = quantize_int8_blocks(torch.randn(n, k, generator=gen))
        else:  # Q5_0: every 5-bit value, scales as a file's
            q = pack_fives(torch.randint(-16, 16, (n, k), generator=gen))
            scale = (torch.rand(n, k // 32, generator=gen) / 8).half()
        layer = BlockQuantLinear(fmt, q, scale, None, None)
        layer.ops = ops
        layers.append(layer)
    fp32 = [dequantize(fmt.kind, b.q, b.scale, None, fmt.group) for b in layers]
    flops = sum(2 * PREFILL_ROWS * n * k for n, k in SMALL_SHAPES)
    xs = [torch.randn(PREFILL_ROWS, k, generator=gen) for _, k in SMALL_SHAPES]
    ways = {
        "the engine's": lambda: [b(x) for b, x in zip(layers, xs, strict=True)],
        "widened tiles + oneDNN fp32":
            lambda: [b._tiled(x) for b, x in zip(layers, xs, strict=True)],
        "oneDNN fp32 GEMM": lambda: [_gemm(x, w, None) for w, x in zip(fp32, xs, strict=True)],
    }
    if ops.block_tiles_path() == "avx512_vnni":  # what an AVX-512 CPU without VNNI takes
        ways["AVX2 tiles (VNNI off)"] = lambda: _without_vnni(ops, ways["the engine's"])
    return _time_ways(ways, flops, repeats)


def _without_vnni(ops: Any, fn: Any) -> Any:
    was = ops.block_tiles_set_vnni(False)
    try:
        return fn()
    finally:
        ops.block_tiles_set_vnni(was)


def run(opts: BenchOptions) -> tuple[BenchResult, Any]:
    ops = load_cpu_ops()
    if ops is None:
        raise RuntimeError("octavo's compiled CPU ops cannot be built here: nothing to measure")
    repeats = opts.reps(3, 7)
    layers = opts.pick(2, 4)
    gen = torch.Generator().manual_seed(opts.seed)
    threads_was = torch.get_num_threads()
    bandwidth = {}
    results: dict[str, Any] = {"kernel": ops.kquant_kernel(), "isa": ops.isa(),
                               "int8_tiles_32": bool(ops.block_int8_tiles()),
                               "tiles_32_path": ops.block_tiles_path()}
    try:
        for threads in THREADS:
            torch.set_num_threads(threads)
            bandwidth[threads] = read_bandwidth(repeats)
        for name in NAMES:
            kind = FORMATS[name][0].kind
            results[name] = {"in_cache": in_cache(ops, kind, repeats, gen),
                             "decode": decode(ops, kind, layers, repeats, gen),
                             "prefill": prefill(ops, name, max(1, repeats // 2), gen)}
        for name in NAMES_32:
            results[name] = {"prefill": prefill_32(ops, name, max(1, repeats // 2), gen)}
    finally:
        torch.set_num_threads(threads_was)
    results["read_gb_s"] = bandwidth
    rows = []
    for name in NAMES:
        for r in results[name]["decode"]:
            cpu = r["cpu_time_weight_gb_s"]
            rows.append([name, r["threads"], r["rows"], r["ms"], r["weight_gb_s"],
                         100 * r["weight_gb_s"] / bandwidth[r["threads"]][0],
                         r["weight_rows_s"] / 1e6, r["weight_rows_s"] * r["rows"] / 1e6,
                         "" if cpu is None else f"{cpu:.1f} ({100 * cpu / bandwidth[1][1]:.0f}%)"])
    md = md_table(["format", "threads", "rows (M)", "ms / pass", "weight GB/s",
                   "% of read bandwidth", "weight rows/s (M)", "output values/s (M)",
                   "1 thread by CPU time: GB/s (% of the read's)"], rows)
    prow = []
    for name in NAMES:
        by = {(r["threads"], r["way"]): r["gflop_s"] for r in results[name]["prefill"]}
        for (threads, way), g in by.items():
            prow.append([name, threads, way, g, g / by[(threads, "torch fp32 GEMM (F.linear)")]])
    md += ("\n\nOne row through a weight held in L2, one thread, by CPU time (the kernel's own "
           "rate): " + ", ".join(
               f"{name} {results[name]['in_cache']['cpu_time_weight_gb_s']:.1f} GB/s"
               for name in NAMES)
           + ".\n\nRead bandwidth (streaming sum over 512 MiB): "
           + ", ".join(f"{t} thread{'s' if t > 1 else ''} {bw[0]:.1f} GB/s"
                       for t, bw in bandwidth.items())
           + f" (1 thread by CPU time: {bandwidth[1][1]:.1f} GB/s)"
           + f"; kernel path {results['kernel']} ({results['isa']} build).\n\n"
           + f"Prefill, {PREFILL_ROWS} rows through one decoder layer's linears:\n\n"
           + md_table(["format", "threads", "path", "GFLOP/s", "x torch fp32 GEMM"], prow))
    srow = []
    for name in NAMES_32:
        by = {(r["threads"], r["way"]): r["gflop_s"] for r in results[name]["prefill"]}
        for (threads, way), g in by.items():
            srow.append([name, threads, way, g, g / by[(threads, "oneDNN fp32 GEMM")]])
    engine_way = (f"integer tiles ({results['tiles_32_path']}, {results['isa']} build)"
                  if results["int8_tiles_32"]
                  else "widened tiles + oneDNN fp32")
    md += (f"\n\nPrefill of the 32-weight formats, {PREFILL_ROWS} rows through Gemma 3 270M's "
           f"q, k, v and gate_up shapes (the engine's way here: {engine_way}):\n\n"
           + md_table(["format", "threads", "path", "GFLOP/s", "x oneDNN fp32 GEMM"], srow))
    config = {"repeats": repeats, "decoder_layers": layers, "shapes": LAYER_SHAPES,
              "lm_head": (VOCAB, HIDDEN), "decode_rows": DECODE_ROWS,
              "prefill_rows": PREFILL_ROWS, "threads": THREADS,
              "small_shapes": SMALL_SHAPES}
    return BenchResult("kquant", opts.command, config, results, md), plot


def plot(results: dict[str, Any], fig: Figure) -> None:
    ax1, ax2 = fig.subplots(1, 2)
    bandwidth = {int(t): bw[0] for t, bw in results["read_gb_s"].items()}
    for name in NAMES:
        for threads in THREADS:
            pts = [r for r in results[name]["decode"] if r["threads"] == threads]
            ax1.plot([r["rows"] for r in pts], [r["weight_gb_s"] for r in pts], marker="o",
                     label=f"{name}, {threads} thr")
    for threads, bw in bandwidth.items():
        ax1.axhline(bw, ls="--", color="0.5", lw=0.8)
        ax1.text(1, bw, f" read bandwidth, {threads} thr", fontsize=7, va="bottom")
    ax1.set_xscale("log", base=2)
    ax1.set_xlabel("rows (M)")
    ax1.set_ylabel("weight GB/s")
    ax1.legend(fontsize=7)
    labels, values = [], []
    for name in NAMES:
        for r in results[name]["prefill"]:
            if r["threads"] == max(THREADS):
                labels.append(f"{name}\n{r['way'].split(' (')[0]}")
                values.append(r["gflop_s"])
    ax2.barh(range(len(values)), values)
    ax2.set_yticks(range(len(values)), labels, fontsize=6)
    ax2.set_xlabel(f"GFLOP/s, prefill {PREFILL_ROWS} rows, {max(THREADS)} threads")
