"""A/B of paged_decode at batch 1: the committed kernels (old, built from a `git archive HEAD` copy of
the csrc directory at OLD) against the working tree's (new), alternated in one process; asserts
bit-identical outputs. Usage: PYTHONPATH=. python ab_avx2_blocking.py THREADS HEAD_DIM."""
import sys, time, torch
from torch.utils.cpp_extension import load
from octavo.model.kernels.cpu_ops import SOURCES, ISA_CFLAGS, load_cpu_ops
import os
old_dir = os.environ.get("OLD", "/tmp/old") + "/octavo/model/kernels/csrc"
old = load(name="octavo_old_ab", sources=[f"{old_dir}/{s}" for s in SOURCES], extra_include_paths=[old_dir],
           extra_cflags=["-O3", "-fopenmp", *ISA_CFLAGS["avx2"]], extra_ldflags=["-fopenmp"],
           build_directory=os.environ.get("OLD", "/tmp/old") + "/build", verbose=False)
new = load_cpu_ops()
torch.set_num_threads(int(sys.argv[1]))
hd = int(sys.argv[2]); kvdt = sys.argv[3] if len(sys.argv) > 3 else "fp32"
H, kvh = (4, 1) if hd == 256 else (12, 2)
nb, bs = 512, 16
kc = torch.randn(nb, bs, kvh, hd); vc = torch.randn(nb, bs, kvh, hd)
q = torch.randn(1, H, hd)
def t(ops, tables, lens, n=40):
    a = time.perf_counter()
    for _ in range(n): ops.paged_decode(q, kc, vc, tables, lens, 0.0625, None, 0, 0.0, None, None)
    return (time.perf_counter() - a) / n
for ctx in (64, 128, 520):
    tables = torch.arange(0, 40).view(1, -1).long(); lens = torch.tensor([ctx]).long()
    a = old.paged_decode(q, kc, vc, tables, lens, 0.0625, None, 0, 0.0, None, None)
    b = new.paged_decode(q, kc, vc, tables, lens, 0.0625, None, 0, 0.0, None, None)
    assert torch.equal(a, b), (a - b).abs().max()
    ta, tb = [], []
    for _ in range(15):
        ta.append(t(old, tables, lens)); tb.append(t(new, tables, lens))
    ta.sort(); tb.sort()
    print(f"hd {hd} ctx {ctx}: old {ta[7]*1e6:.1f} us new {tb[7]*1e6:.1f} us  new/old {tb[7]/ta[7]:.2f} (min {tb[0]/ta[0]:.2f})", flush=True)
