import sys, time, statistics, torch
from octavo.model.kernels.cpu_ops import load_cpu_ops
m = load_cpu_ops()
torch.set_num_threads(int(sys.argv[1]))
BLOCK, kvh, heads, hd, layers = 16, 3, 9, 64, 30
for ctx_n in (256, 320, 384, 1024):
    nb = -(-ctx_n // BLOCK)
    gen = torch.Generator().manual_seed(0)
    caches = [(torch.randn(nb, BLOCK, kvh, hd), torch.randn(nb, BLOCK, kvh, hd)) for _ in range(layers)]
    tables = torch.randperm(nb, generator=gen).view(1, nb)
    ctx = torch.tensor([ctx_n]); q = torch.randn(1, heads, hd)
    ts = []
    for r in range(15):
        t = time.perf_counter()
        for kc, vc in caches: m.paged_decode(q, kc, vc, tables, ctx, 0.125)
        ts.append(time.perf_counter() - t)
    print(f"threads {sys.argv[1]} ctx {ctx_n}: {1e3*statistics.median(ts):.3f} ms per 30 layers")
