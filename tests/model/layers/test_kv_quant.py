"""Quantized KV pages (kv_quant.py): every writer stores the same bytes, and every attention
path reading int8 / fp8 pages equals dequantize-then-attend in fp32 on the same pages.

Backends: torch, the compiled CPU kernels on every ISA build this CPU runs (decode and prefill),
and the Triton kernels in Triton's interpreter. Cases: block sizes 1 to 32, GQA ratios 1, 2, 3, 8
and 10 (the SIMD decode paths of quantized pages take a group's heads 8 at a time), head dims
64 and 128 (the unrolled decode paths) and 16 (the generic one), prompts from 0,
prefix offsets (start_pos > 0, mid-block), decodes, sliding windows and soft caps.

Tolerances, against the fp32 reference on the same pages (the pages hold identical bytes, so only
the order of the sums differs): fp32 queries 2e-5 for every KV dtype; bf16 queries 2e-2 (the
output and, in Triton, the softmax weights are rounded to bf16). What quantization itself costs
against model-dtype pages is bounded per KV dtype in test_quantization_error.
"""

from __future__ import annotations

import random

import pytest
import torch

from octavo.model.kernels.cpu_isa import supported_isas
from octavo.model.kernels.cpu_ops import load_cpu_ops
from octavo.model.layers.attention import get_backend
from octavo.model.layers.attention.base import PrefillChunk
from octavo.model.layers.kv_quant import (
    KVQuant,
    dequantize,
    gather_rows,
    kv_format,
    quantize,
    write_quantized,
)
from tests.model.layers.test_paged_attention import step_meta

ISAS = supported_isas()
KV_DTYPES = ["int8", "fp8_e4m3", "fp8_e5m2"]


def make_quant(name: str, kv_heads: int, gen: torch.Generator) -> KVQuant:
    fmt = kv_format(name, torch.float32)
    if not fmt.is_fp8:
        return KVQuant(fmt)
    # per-head scales of different sizes; some keys saturate (|x| / scale > max)
    k_scale = (torch.rand(kv_heads, generator=gen) + 0.5) * 4.0 / fmt.fp8_max
    v_scale = (torch.rand(kv_heads, generator=gen) + 0.5) * 4.0 / fmt.fp8_max
    return KVQuant(fmt, k_scale, v_scale)


def reference(q, k_cache, v_cache, table, start_pos, quant, scale, window, softcap):
    """Dense causal attention in fp32 over the dequantized pages of one sequence."""
    n, heads, d = q.shape
    ctx = start_pos + n
    bs = k_cache.shape[1]
    blocks = torch.tensor(table[: -(-ctx // bs)])
    keys = dequantize(gather_rows(k_cache, blocks).flatten(0, 1)[:ctx], quant.fmt,
                      quant.k_scale)
    values = dequantize(gather_rows(v_cache, blocks).flatten(0, 1)[:ctx], quant.fmt,
                        quant.v_scale)
    rep = heads // keys.shape[1]
    keys, values = keys.repeat_interleave(rep, 1), values.repeat_interleave(rep, 1)
    s = torch.einsum("qhd,khd->hqk", q.double(), keys.double()) * scale
    if softcap:
        s = torch.tanh(s / softcap) * softcap
    q_pos = torch.arange(start_pos, ctx)[:, None]
    k_pos = torch.arange(ctx)[None, :]
    seen = k_pos <= q_pos
    if window:
        seen &= k_pos > q_pos - window
    s = s.masked_fill(~seen, float("-inf"))
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), values.double()).float()


def run_case(backend, name, seqs, heads, kv_heads, head_dim, block_size, dtype, seed,
             window=None, softcap=None):
    """seqs: (tokens already in the cache, new tokens), decodes first. The cached prefixes are
    written by the torch writer, the step's tokens by the backend's own."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    quant = make_quant(name, kv_heads, gen)
    num_blocks = sum(-(-(c + n) // block_size) for c, n in seqs) + 2
    width = quant.fmt.row_elems(head_dim)
    k_cache = torch.zeros(num_blocks, block_size, kv_heads, width, dtype=quant.fmt.dtype)
    v_cache = torch.zeros_like(k_cache)
    free = list(range(num_blocks))
    rng.shuffle(free)
    qs, ks, vs, slots, tables, prefills, decodes = [], [], [], [], [], [], []
    row = 0
    for i, (cached, new) in enumerate(seqs):
        ctx = cached + new
        table = [free.pop() for _ in range(-(-ctx // block_size))]
        tables.append(table)
        k = torch.randn(ctx, kv_heads, head_dim, generator=gen) * 2
        v = torch.randn(ctx, kv_heads, head_dim, generator=gen)
        pos_slots = [table[p // block_size] * block_size + p % block_size for p in range(ctx)]
        if cached:
            write_quantized(k[:cached], v[:cached], k_cache, v_cache,
                            torch.tensor(pos_slots[:cached]), quant)
        qs.append(torch.randn(new, heads, head_dim, generator=gen) * 2)
        ks.append(k[cached:])
        vs.append(v[cached:])
        slots += pos_slots[cached:]
        if new > 1:
            prefills.append(PrefillChunk(row, row + new, cached, torch.tensor(table)))
        else:
            decodes.append(i)
        row += new
    assert decodes == list(range(len(decodes))), "decodes first"
    meta = step_meta(slots, tables, decodes, [sum(seqs[i]) for i in decodes], prefills)
    q = torch.cat(qs).to(dtype)
    scale = head_dim**-0.5
    out = backend.forward(q, torch.cat(ks).to(dtype), torch.cat(vs).to(dtype), k_cache, v_cache,
                          meta, scale, window, softcap, kv=quant)
    assert out.dtype == dtype and out.shape == q.shape
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    row = 0
    for i, (cached, new) in enumerate(seqs):
        ref = reference(q[row:row + new].float(), k_cache, v_cache, tables[i], cached, quant,
                        scale, window, softcap)
        err = ((out[row:row + new].float() - ref).abs() - tol * ref.abs()).max().item()
        assert err <= tol, f"sequence {i} {seqs[i]}: off by {err} (tolerance {tol})"
        row += new
    # the step's rows are stored exactly as kv_quant.quantize stores them
    expect = quantize(torch.cat(ks).to(dtype), quant.fmt, quant.k_scale)
    stored = gather_rows(k_cache.view(-1, kv_heads, width), torch.tensor(slots))
    assert torch.equal(stored.view(torch.uint8), expect.view(torch.uint8))


@pytest.fixture(params=["torch", *(f"cpu-{isa}" for isa in ISAS)])
def backend(request):
    name, _, isa = request.param.partition("-")
    return get_backend(name, torch.device("cpu"), isa or None)


SEQS = [(0, 1), (15, 1), (16, 1), (70, 1), (0, 37), (0, 3), (32, 17), (21, 40)]


@pytest.mark.parametrize("name", KV_DTYPES)
@pytest.mark.parametrize("block_size", [1, 16])
def test_pages_read_as_stored(backend, name, block_size):
    run_case(backend, name, SEQS, 6, 2, 64, block_size, torch.float32, seed=block_size)


@pytest.mark.parametrize("name", KV_DTYPES)
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(4, 4, 128), (16, 2, 64), (20, 2, 64),
                                                      (6, 3, 16)])
def test_gqa_ratios_and_head_dims(backend, name, heads, kv_heads, head_dim):
    run_case(backend, name, [(0, 1), (40, 1), (0, 20), (9, 12)], heads, kv_heads, head_dim,
             32, torch.float32, seed=heads + head_dim)


@pytest.mark.parametrize("name", ["int8", "fp8_e4m3"])
@pytest.mark.parametrize("window, softcap", [(7, None), (None, 15.0), (20, 3.0)])
def test_windows_and_soft_caps(backend, name, window, softcap):
    run_case(backend, name, [(0, 1), (30, 1), (0, 45), (33, 20)], 8, 2, 64, 8,
             torch.float32, seed=5, window=window, softcap=softcap)


@pytest.mark.parametrize("name", KV_DTYPES)
def test_bfloat16_queries(backend, name):
    run_case(backend, name, [(0, 1), (50, 1), (0, 30), (17, 9)], 6, 2, 64, 16,
             torch.bfloat16, seed=9)


@pytest.mark.parametrize("name, block_size, window, softcap, dtype", [
    ("int8", 16, None, None, torch.float32),
    ("fp8_e4m3", 8, 20, 3.0, torch.float32),
    ("fp8_e5m2", 1, None, None, torch.bfloat16),
])
def test_triton_kernels(name, block_size, window, softcap, dtype):
    """The Triton write, decode and prefill kernels (in Triton's interpreter on this machine):
    few, small cases, the interpreter paying per program and per op."""
    triton = get_backend("triton", torch.device("cpu"))
    run_case(triton, name, [(0, 1), (21, 1), (0, 9), (17, 6)], 4, 2, 64, block_size, dtype,
             seed=block_size, window=window, softcap=softcap)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("name", KV_DTYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_write_stores_the_same_bytes(isa, name, dtype):
    """kv_write (C++) and kv_quant.quantize agree bit for bit, over rows of every magnitude,
    zero rows and saturating ones."""
    ops = load_cpu_ops(isa)
    gen = torch.Generator().manual_seed(3)
    quant = make_quant(name, 3, gen)
    x = torch.randn(40, 3, 64, generator=gen) * torch.logspace(-6, 3, 40)[:, None, None]
    x[5] = 0
    x = x.to(dtype)
    cache = torch.zeros(8, 8, 3, quant.fmt.row_elems(64), dtype=quant.fmt.dtype)
    other = torch.zeros_like(cache)
    slots = torch.randperm(64, generator=gen)[:40]
    ops.kv_write(x, x, cache, other, slots, quant.k_scale, quant.k_scale)
    expect = quantize(x, quant.fmt, quant.k_scale)
    got = gather_rows(cache.view(-1, 3, cache.shape[-1]), slots)
    assert torch.equal(got.view(torch.uint8), expect.view(torch.uint8))


@pytest.mark.parametrize("name", KV_DTYPES)
def test_quantization_error(name):
    """What each KV dtype costs against fp32 pages: per element, relative to the row's largest
    value (int8: half a step, 1/254; fp8: half a unit in the last place, 1/16 for e4m3 and 1/8
    for e5m2, relative to the element itself), and on attention outputs relative to the largest
    value (int8 0.1%, e4m3 0.5%, e5m2 1%), at the scales calibration sets."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(500, 4, 64, generator=gen)
    quant = make_quant(name, 4, gen)
    if quant.fmt.is_fp8:  # scales as calibration sets them: the largest |x| at max / 2.24
        amax = x.abs().amax(dim=(0, 2))
        quant = KVQuant(quant.fmt, amax * 2.24 / quant.fmt.fp8_max,
                        amax * 2.24 / quant.fmt.fp8_max)
    err = (dequantize(quantize(x, quant.fmt, quant.k_scale), quant.fmt, quant.k_scale) - x)
    rel = (err.abs() / x.abs().amax(-1, keepdim=True)).max().item()
    elem_bound, attn_bound = {"int8": (1 / 254 + 1e-6, 1e-3), "fp8_e4m3": (1 / 16, 5e-3),
                              "fp8_e5m2": (1 / 8, 1e-2)}[name]
    assert rel <= elem_bound
    q = torch.randn(1, 8, 64, generator=gen)
    k_hat = dequantize(quantize(x, quant.fmt, quant.k_scale), quant.fmt, quant.k_scale)
    v_hat = dequantize(quantize(x.flip(0), quant.fmt, quant.v_scale), quant.fmt, quant.v_scale)
    exact = torch.softmax(torch.einsum("qhd,khd->hqk", q, x.repeat_interleave(2, 1)) / 8, -1)
    approx = torch.softmax(torch.einsum("qhd,khd->hqk", q, k_hat.repeat_interleave(2, 1)) / 8,
                           -1)
    o_exact = torch.einsum("hqk,khd->qhd", exact, x.flip(0).repeat_interleave(2, 1))
    o_approx = torch.einsum("hqk,khd->qhd", approx, v_hat.repeat_interleave(2, 1))
    assert (o_approx - o_exact).abs().max().item() <= attn_bound * x.abs().max().item()
