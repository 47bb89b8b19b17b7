import time, statistics, torch, torch.nn.functional as F
from octavo.model.kernels.cpu_ops import load_cpu_ops
torch.set_num_threads(1)
ops = load_cpu_ops()
print("isa", ops.isa())
BS, kvh, H, D = 16, 3, 9, 64
def bench(f, reps=15):
    f(); ts=[]
    for _ in range(reps):
        t=time.perf_counter(); f(); ts.append(time.perf_counter()-t)
    return statistics.median(ts)
for L, nseq in [(128, 8), (256, 4), (512, 2)]:
    nb = L // BS
    total = nb * nseq
    kc = torch.randn(total, BS, kvh, D); vc = torch.randn(total, BS, kvh, D)
    perm = torch.randperm(total)
    tables = perm.view(nseq, nb)
    q = torch.randn(nseq * L, H, D)
    qs = torch.arange(nseq + 1) * L
    sp = torch.zeros(nseq, dtype=torch.long)
    t = bench(lambda: ops.paged_prefill(q, kc, vc, tables, qs, sp, 0.125, 0, 0.0, True))
    flops = 128 * L * L * H * nseq  # causal half
    # reference: SDPA per sequence, contiguous K/V with GQA expanded
    ks = [kc[tables[s]].reshape(L, kvh, D).repeat_interleave(3, 1).transpose(0, 1) for s in range(nseq)]
    vs = [vc[tables[s]].reshape(L, kvh, D).repeat_interleave(3, 1).transpose(0, 1) for s in range(nseq)]
    qq = [q[s*L:(s+1)*L].transpose(0, 1) for s in range(nseq)]
    t2 = bench(lambda: [F.scaled_dot_product_attention(qq[s], ks[s], vs[s], is_causal=True, scale=0.125) for s in range(nseq)])
    print(f"L {L} x{nseq}: paged_prefill {t*1e3:.2f} ms {flops/t/1e9:.1f} GFLOP/s | sdpa {t2*1e3:.2f} ms {flops/t2/1e9:.1f} GFLOP/s (causal-half flops)")
a = torch.randn(512, 576); b = torch.randn(576, 1536)
t = bench(lambda: a @ b); print(f"matmul 512x576x1536: {2*512*576*1536/t/1e9:.1f} GFLOP/s")
