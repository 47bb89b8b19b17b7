"""Q5_0 blocks against the same values as Q8_0 blocks, one activation row, weights from memory
(64 MB of copies), medians of 9. Usage: PYTHONPATH=. python q5_0_one_row.py THREADS."""
import sys, time, torch
from octavo.model.kernels.cpu_ops import load_cpu_ops
from octavo.model.quant.block_quant import INT5, INT8, pack_fives, unpack_fives
ops = load_cpu_ops()
torch.set_num_threads(int(sys.argv[1]))
gen = torch.Generator().manual_seed(0)
for n, k in ((4096, 640), (1024, 640), (262144, 640)):
    # many copies so the weights come from memory, as in a decode step
    copies = max(1, (64 << 20) // (n * k))
    q5 = [pack_fives(torch.randint(-16, 16, (n, k), generator=gen)) for _ in range(copies)]
    q8 = [unpack_fives(q) for q in q5]
    s = (torch.rand(n, k // 32) / 8).half()
    x = torch.randn(1, k)
    def run(kind, qs):
        for q in qs: ops.block_linear(x, kind, q, s, None, 32, None, True)
    r5, r8 = [], []
    for _ in range(9):
        a = time.perf_counter(); run(INT5, q5); r5.append((time.perf_counter() - a) / copies)
        a = time.perf_counter(); run(INT8, q8); r8.append((time.perf_counter() - a) / copies)
    r5.sort(); r8.sort()
    print(f"[{n}x{k}] M=1: q5 {r5[4]*1e6:.0f} us ({n*k*22/32/r5[4]/1e9:.1f} GB/s)  q8 {r8[4]*1e6:.0f} us ({n*k*34/32/r8[4]/1e9:.1f} GB/s)  q5/q8 {r5[4]/r8[4]:.2f}", flush=True)
