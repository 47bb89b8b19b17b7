import sys, torch
from octavo.model.kernels.cpu_ops import load_cpu_ops
res = {}
for isa in ("avx512", "avx2", "portable"):
    m = load_cpu_ops(isa)
    for dtype in (torch.float32, torch.bfloat16):
        for (H, KVH, D) in ((9, 3, 64), (32, 8, 128), (8, 1, 64), (6, 6, 48)):
            for B in (1, 2, 3):
                g = torch.Generator().manual_seed(H * 7 + B)
                nb = 40
                k = torch.randn(nb * B + 1, 16, KVH, D, generator=g).to(dtype); v = torch.randn(k.shape, generator=g).to(dtype)
                q = torch.randn(B, H, D, generator=g).to(dtype)
                tables = torch.randperm(nb * B, generator=g).view(B, nb)
                ctx = torch.tensor([600, 37, 333][:B])
                for th in (1, 2, 4):
                    torch.set_num_threads(th)
                    out = m.paged_decode(q, k, v, tables, ctx, D ** -0.5)
                    out2 = m.paged_decode(q, k, v, tables, ctx, D ** -0.5, torch.zeros(B, dtype=torch.long), 100, 30.0)
                    res[(isa, str(dtype), H, KVH, D, B, th)] = (out, out2)
torch.save(res, sys.argv[1])
