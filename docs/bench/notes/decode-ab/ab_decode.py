"""A/B the decode kernel: variants of csrc built side by side, decode attention of a whole step."""
import os, shutil, sys, time, statistics, subprocess
import torch
from torch.utils.cpp_extension import load
from octavo.model.kernels.cpu_isa import ISA_CFLAGS
from octavo.model.kernels.cpu_ops import SOURCES, _CSRC

def build(tag, patch):
    src = f"/tmp/octavo-ab/ab/src_{tag}"
    shutil.rmtree(src, ignore_errors=True); shutil.copytree(_CSRC, src)
    if patch: patch(src)
    b = f"/tmp/octavo-ab/ab/build_{tag}_{os.environ.get('ISA', 'avx512')}"; os.makedirs(b, exist_ok=True)
    return load(name=f"ab_{tag}_{os.environ.get('ISA', 'avx512')}", sources=[f"{src}/{s}" for s in SOURCES], extra_include_paths=[src],
                extra_cflags=["-O3", "-fopenmp", *ISA_CFLAGS[os.environ.get("ISA", "avx512")]], extra_ldflags=["-fopenmp"],
                build_directory=b, verbose=False)

def nopf(src):
    p = f"{src}/block_prefetch.h"; t = open(p).read()
    t = t.replace("void some() {", "void some() { return;")
    open(p, "w").write(t)

def hint(n):
    def f(src):
        p = f"{src}/block_prefetch.h"; t = open(p).read()
        old = ", 0, 3);" if ", 0, 3);" in t else ", 0, 2);"
        assert old in t
        open(p, "w").write(t.replace(old, f", 0, {n});"))
    return f
def ahead2(src):
    p = f"{src}/decode_avx512.h"; t = open(p).read()
    a = "if (j + 1 < nblocks)\n      ahead.start(k_cache + table[j + 1] * block_elems, v_cache + table[j + 1] * block_elems);"
    assert a in t
    open(p, "w").write(t.replace(a, a.replace("j + 1", "j + 2")))
def fine(src):
    p = f"{src}/decode_avx512.h"; t = open(p).read()
    a = "ahead(block_bytes, num_heads * ((block_size + 15) / 16));"
    b = "                part[t] = s;\n"
    assert a in t and b in t
    t = t.replace(a, "ahead(block_bytes, 17 * num_heads * ((block_size + 15) / 16));").replace(b, b + "                ahead.some();\n")
    open(p, "w").write(t)
VARIANTS = {"base": None, "nopf": nopf, "t1": hint(2), "t0": hint(3), "t2": hint(1), "nta": hint(0), "ahead2": ahead2, "fine": fine}
extra = sys.argv[2:] if len(sys.argv) > 2 else list(VARIANTS)
mods = {k: build(k, VARIANTS[k]) for k in extra}
torch.set_num_threads(int(sys.argv[1]))
BLOCK, kvh, heads, hd, batch, layers = 16, 3, 9, 64, 64, 30
gen = torch.Generator().manual_seed(1)
ctx = torch.randint(40, 641, (batch,), generator=gen)
nblocks = [-(-int(n) // BLOCK) for n in ctx]; total = sum(nblocks)
perm = torch.randperm(total, generator=gen).tolist()
tables = torch.zeros(batch, max(nblocks), dtype=torch.long)
for b, nb in enumerate(nblocks):
    tables[b, :nb] = torch.tensor(perm[:nb]); perm = perm[nb:]
for dtype in (torch.float32, torch.bfloat16):
    caches = [(torch.randn(total, BLOCK, kvh, hd, generator=gen).to(dtype),
               torch.randn(total, BLOCK, kvh, hd, generator=gen).to(dtype)) for _ in range(layers)]
    q = torch.randn(batch, heads, hd, generator=gen).to(dtype)
    kv_bytes = 2 * int(ctx.sum()) * kvh * hd * dtype.itemsize * layers
    res = {k: [] for k in mods}
    ref = None
    for rnd in range(9):
        for k, m in mods.items():
            for kc, vc in caches[:2]: m.paged_decode(q, kc, vc, tables, ctx, hd**-0.5)
            t = time.perf_counter()
            for _ in range(3):
                for kc, vc in caches: out = m.paged_decode(q, kc, vc, tables, ctx, hd**-0.5)
            res[k].append((time.perf_counter() - t) / 3)
            if ref is None: ref = out
            else: assert torch.equal(ref, out), k
    for k, v in res.items():
        ms = 1e3 * statistics.median(v)
        print(f"threads {sys.argv[1]} {str(dtype)[6:]:9s} {k:8s} {ms:7.2f} ms/step  {kv_bytes/ms/1e6:5.1f} GB/s")
