"""Prefill-sized batches of Gemma's block layers: integer kernel (block_linear at M rows) vs
widened tiles + oneDNN (BlockQuantLinear._tiled)."""
import sys, time, torch
from octavo.model.kernels.cpu_ops import load_cpu_ops
from octavo.model.quant.block_quant import BlockQuantLinear, BlockFormat, INT5, INT8, pack_fives, quantize_int8_blocks
ops = load_cpu_ops()
torch.set_num_threads(int(sys.argv[1]))
M = int(sys.argv[2]) if len(sys.argv) > 2 else 512
gen = torch.Generator().manual_seed(0)
def layer(kind, n, k):
    if kind == INT5:
        q = pack_fives(torch.randint(-16, 16, (n, k), generator=gen)); s = (torch.rand(n, k // 32) / 8).half()
        l = BlockQuantLinear(BlockFormat("q5_0", INT5, 32, True), q, s, None, None)
    else:
        q, s = quantize_int8_blocks(torch.randn(n, k))
        l = BlockQuantLinear(BlockFormat("q8_0", INT8, 32, True), q, s, None, None)
    l.ops = ops
    return l
def t(f, r=5):
    f(); best = []
    for _ in range(r):
        a = time.perf_counter(); f(); best.append(time.perf_counter() - a)
    best.sort(); return best[len(best) // 2]
for name, kind, n, k in (("q5 gate_up", INT5, 4096, 640), ("q5 q", INT5, 1024, 640), ("q8 v", INT8, 256, 640), ("q8 0", INT8, 2048, 640)):
    l = layer(kind, n, k)
    x = torch.randn(M, k)
    ti = t(lambda: ops.block_linear(x, kind, l.q, l.scale, None, 32, None, True))
    tt = t(lambda: l._tiled(x))
    fl = 2 * M * n * k
    print(f"{name} [{n}x{k}] M={M}: int kernel {ti*1e3:.2f} ms ({fl/ti/1e9:.1f} G/s)  tiles {tt*1e3:.2f} ms ({fl/tt/1e9:.1f} G/s)  int/tiles {ti/tt:.2f}", flush=True)
