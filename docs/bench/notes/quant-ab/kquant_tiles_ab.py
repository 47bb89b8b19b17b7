"""A/B of kquant_linear: the committed kernels (old, built from a `git archive` copy of the csrc
directory at OLD) against the working tree's (new), alternated in one process, at the
Qwen2.5-Coder-1.5B layer shapes; asserts bit-identical outputs (row 0 scaled by 1000).
Usage: PYTHONPATH=. OLD=/tmp/old python kquant_tiles_ab.py THREADS M[,M...] [SHAPE,...]
(CLOSE=1: where the change moves the fp32 steps, outputs within 1e-5 relative instead of equal;
REPS=n: alternated calls per shape; OPENBLAS_NUM_THREADS=1 keeps numpy's threads from spinning)
(shapes: qkv gate_up down4 down6 v6 q5k). G/s counts 2 M N K integer ops."""
import os
import sys
import time

import torch
from torch.utils.cpp_extension import load

from octavo.model.kernels.cpu_ops import ISA_CFLAGS, SOURCES, load_cpu_ops
from octavo.model.quant import kquant

root = os.environ.get("OLD", "/tmp/old")
old_dir = f"{root}/octavo/model/kernels/csrc"
os.makedirs(f"{root}/build", exist_ok=True)
old = load(name="octavo_old_ab", sources=[f"{old_dir}/{s}" for s in SOURCES],
           extra_include_paths=[old_dir], extra_cflags=["-O3", "-fopenmp", *ISA_CFLAGS["avx2"]],
           extra_ldflags=["-fopenmp"], build_directory=f"{root}/build", verbose=False)
new = load_cpu_ops()
torch.set_num_threads(int(sys.argv[1]))
sizes = [int(v) for v in sys.argv[2].split(",")]
SHAPES = {"qkv": ("qkv Q4_K", kquant.Q4_K, 2048, 1536),
          "gate_up": ("gate_up Q4_K", kquant.Q4_K, 8960, 1536),
          "down4": ("down Q4_K", kquant.Q4_K, 1536, 8960),
          "down6": ("down Q6_K", kquant.Q6_K, 1536, 8960),
          "v6": ("v Q6_K", kquant.Q6_K, 1536, 1536),
          "q5k": ("Q5_K", kquant.Q5_K, 1536, 1536)}
names = sys.argv[3].split(",") if len(sys.argv) > 3 else ["qkv", "gate_up", "down6", "q5k"]
gen = torch.Generator().manual_seed(0)


def timed(ops, x, kind, q):
    s = time.perf_counter()
    ops.kquant_linear(x, kind, q, None)
    return time.perf_counter() - s


for label, kind, n, k in (SHAPES[s] for s in names):
    q = kquant.repack(kind, kquant.random_blocks(kind, n, k, gen))
    for m in sizes:
        x = torch.randn(m, k, generator=gen)
        x[0] *= 1000
        a, b = old.kquant_linear(x, kind, q, None), new.kquant_linear(x, kind, q, None)
        if os.environ.get("CLOSE"):
            assert torch.allclose(a, b, rtol=1e-5, atol=1e-5 * a.abs().max().item()), (label, m)
        else:
            assert torch.equal(a, b), (label, m, (a - b).abs().max())
        reps = int(os.environ.get("REPS", 0)) or (61 if m < 4 else (15 if m < 64 else 5))

        ta, tb = [], []
        for _ in range(reps):
            ta.append(timed(old, x, kind, q))
            tb.append(timed(new, x, kind, q))
        ta.sort()
        tb.sort()
        h, ops = reps // 2, 2 * m * n * k
        print(f"{label:13s} M={m:4d}: old {ta[h] * 1e3:8.3f} ms ({ops / ta[h] / 1e9:6.1f} G/s) "
              f"new {tb[h] * 1e3:8.3f} ms ({ops / tb[h] / 1e9:6.1f} G/s) "
              f"new/old {tb[h] / ta[h]:.2f} (fastest calls: {tb[0] / ta[0]:.2f})", flush=True)
