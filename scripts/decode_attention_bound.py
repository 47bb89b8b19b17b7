"""Time the CPU paged decode attention kernel alone at one shape, for fp32, int8 and fp8_e4m3
pages, and set each against its two bounds: the bytes it reads (at the rate the fp32 pages
reach) and the fp32 multiply-adds it computes (every stored value is widened in registers and
dotted with each query head of its GQA group: 2 x head_dim x group per key and KV head).

Default shape: Qwen2.5-Coder-1.5B's attention (12 query heads, 2 KV heads, head_dim 128) for
16 sequences at a 2,000-token context, block size 16. Random pages: the kernel's work does not
depend on the values.

    python scripts/decode_attention_bound.py [--seqs 16] [--context 2000] [--isa avx512]
"""

from __future__ import annotations

import argparse
import time

import torch

from octavo.model.layers.attention import get_backend
from octavo.model.layers.kv_quant import kv_format


def pages(name: str, blocks: int, block_size: int, kv_heads: int, head_dim: int
          ) -> tuple[torch.Tensor, torch.Tensor]:
    if name == "float32":
        return (torch.randn(blocks, block_size, kv_heads, head_dim),
                torch.randn(blocks, block_size, kv_heads, head_dim))
    fmt = kv_format(name, torch.float32)
    width = fmt.row_elems(head_dim)
    if fmt.is_fp8:  # random finite fp8 values
        vals = torch.randn(2, blocks, block_size, kv_heads, width).to(fmt.dtype)
    else:  # int8 values, then each row's fp32 scale in its last 4 bytes
        vals = torch.randint(-127, 128, (2, blocks, block_size, kv_heads, width),
                             dtype=torch.int8)
        scale = torch.full((2, blocks, block_size, kv_heads, 1), 0.01)
        vals[..., head_dim:] = scale.view(torch.int8)
    return vals[0].contiguous(), vals[1].contiguous()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqs", type=int, default=16)
    ap.add_argument("--context", type=int, default=2000)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--isa", default="avx512")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=15)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    kernel = get_backend("cpu", torch.device("cpu"), a.isa).kernel
    nb = -(-a.context // a.block_size)
    tables = torch.arange(a.seqs * nb).view(a.seqs, nb)
    lens = torch.full((a.seqs,), a.context, dtype=torch.int32)
    q = torch.randn(a.seqs, a.heads, a.head_dim)
    fmas = a.seqs * a.context * a.kv_heads * 2 * a.head_dim * (a.heads // a.kv_heads)
    print(f"{a.seqs} x {a.context}, {a.heads}/{a.kv_heads} heads, head_dim {a.head_dim}, "
          f"isa {a.isa}, {a.threads} threads; per layer {fmas / 1e6:.0f} M fp32 multiply-adds")
    print("| pages | ms a layer | ms a step (x layers) | GB/s read | G multiply-adds/s |")
    print("|---|---|---|---|---|")
    for name in ("float32", "int8", "fp8_e4m3"):
        kc, vc = pages(name, a.seqs * nb, a.block_size, a.kv_heads, a.head_dim)
        scales = (() if name != "fp8_e4m3" else
                  (torch.ones(a.kv_heads), torch.ones(a.kv_heads)))
        args = (q, kc, vc, tables, lens, a.head_dim ** -0.5, None, 0, 0.0, *scales)
        kernel.paged_decode(*args)
        times = []
        for _ in range(a.repeats):
            t0 = time.perf_counter()
            kernel.paged_decode(*args)
            times.append(time.perf_counter() - t0)
        t = sorted(times)[len(times) // 2]
        read = 2 * kc.numel() * kc.element_size()
        print(f"| {name} | {t * 1e3:.2f} | {t * a.layers * 1e3:.0f} | {read / t / 1e9:.1f} | "
              f"{fmas / t / 1e9:.1f} |")


if __name__ == "__main__":
    main()
