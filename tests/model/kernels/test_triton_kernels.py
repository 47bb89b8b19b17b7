"""octavo's Triton kernels against the torch backend and torch's own ops.

The tensors live on the tests' device (tests/conftest.py): CPU tensors by default, which the
kernels take in Triton's interpreter, and CUDA tensors with OCTAVO_TEST_DEVICE=cuda
(scripts/gpu_check.sh), which they take compiled.
Grid: head dims 64 and 128, block sizes 16 and 32, GQA ratios 1, 3 and 8, contexts that end
mid-block, prefix hits, sliding windows and soft caps, fp32 and bf16.

Tolerances: fp32 1e-5 (the kernels sum in another order than torch); bf16 2e-2 against the
fp32 reference computed from the same bf16 inputs (the kernels round p to bf16 before the PV
product, as FlashAttention does). Two limits of Triton 3.9's interpreter shape the bf16 checks
on CPU: it rounds fp32 -> bf16 toward zero (a GPU rounds to nearest even), so a bf16 result may
be one unit in the last place off torch's; and it multiplies bf16 tiles in `tl.dot` as raw
integers, so the kernels widen 16-bit tiles before `tl.dot` when interpreted (decode.py's
`_dot`); on a GPU they multiply them natively.
"""

from __future__ import annotations

import random

import pytest
import torch

from octavo.model.kernels.triton import triton_missing
from tests.conftest import TEST_DEVICE as DEVICE

assert triton_missing(DEVICE.type) is None, triton_missing(DEVICE.type)

from octavo.model.kernels.triton import cache_ops, decode  # noqa: E402
from octavo.model.kernels.triton.fused_ops import TritonFusedOps  # noqa: E402
from octavo.model.layers.attention.base import AttentionMetadata, PrefillChunk  # noqa: E402
from octavo.model.layers.attention.torch_backend import TorchAttentionBackend  # noqa: E402
from octavo.model.layers.attention.torch_backend import write_kv as torch_write_kv  # noqa: E402
from octavo.model.layers.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from octavo.model.layers.decoder import RMSNorm, apply_rope  # noqa: E402
from tests.model.layers.test_paged_attention import step_meta  # noqa: E402

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def make_case(seqs: list[tuple[int, int]], heads: int, kv_heads: int, head_dim: int,
              block_size: int, dtype: torch.dtype, seed: int, window_first: int | None = None):
    """seqs: (tokens cached, new tokens) per sequence, decodes (new == 1) first. Returns the
    step's q/k/v, caches holding the cached prefixes at shuffled blocks, and its metadata."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    num_blocks = sum(-(-(c + n) // block_size) for c, n in seqs) + 3
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.zeros(shape, dtype=dtype)
    v_cache = torch.zeros(shape, dtype=dtype)
    free = list(range(num_blocks))
    rng.shuffle(free)
    qs, ks, vs, slots, tables, prefills = [], [], [], [], [], []
    row = 0
    for cached, new in seqs:
        ctx = cached + new
        table = [free.pop() for _ in range(-(-ctx // block_size))]
        tables.append(table)
        k = torch.randn(ctx, kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(ctx, kv_heads, head_dim, generator=gen).to(dtype)
        for p in range(cached):
            k_cache[table[p // block_size], p % block_size] = k[p]
            v_cache[table[p // block_size], p % block_size] = v[p]
        qs.append((torch.randn(new, heads, head_dim, generator=gen) * 2).to(dtype))
        ks.append(k[cached:])
        vs.append(v[cached:])
        slots += [table[p // block_size] * block_size + p % block_size
                  for p in range(cached, ctx)]
        if new > 1:
            prefills.append(PrefillChunk(row, row + new, cached, torch.tensor(table)))
        row += new
    decodes = [i for i, (_, n) in enumerate(seqs) if n == 1]
    assert decodes == list(range(len(decodes))), "decodes first"
    meta = step_meta(slots, tables, decodes, [sum(seqs[i]) for i in decodes], prefills)
    return torch.cat(qs), torch.cat(ks), torch.cat(vs), k_cache, v_cache, meta


def to_device(meta: AttentionMetadata) -> AttentionMetadata:
    def mv(t):
        return None if t is None else t.to(DEVICE)

    return AttentionMetadata(
        mv(meta.slot_mapping), meta.num_decodes, mv(meta.decode_block_tables),
        mv(meta.decode_context_lens),
        [PrefillChunk(c.query_start, c.query_end, c.start_pos, c.block_table.to(DEVICE))
         for c in meta.prefills], mv(meta.decode_first_pos))


def compare(seqs, heads, kv_heads, head_dim, block_size, dtype, seed, window=None,
            softcap=None) -> None:
    """The Triton backend's output and cache writes against the torch backend's; in bf16 the
    reference is the torch backend in fp32 on the same (bf16-rounded) inputs."""
    q, k, v, kc, vc, meta = make_case(seqs, heads, kv_heads, head_dim, block_size, dtype, seed)
    scale = head_dim**-0.5
    ref_cache = (kc.float().clone(), vc.float().clone())
    ref = TorchAttentionBackend().forward(q.float(), k.float(), v.float(), *ref_cache,
                                          meta, scale, window, softcap)
    kc_d, vc_d = kc.to(DEVICE), vc.to(DEVICE)
    out = TritonAttentionBackend().forward(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), kc_d, vc_d,
                                           to_device(meta), scale, window, softcap)
    assert out.dtype == dtype and out.shape == q.shape
    tol = TOL[dtype]
    torch.testing.assert_close(out.float().cpu(), ref, atol=tol, rtol=tol)
    # the step's K/V landed at the slot mapping, bit for bit
    assert torch.equal(kc_d.cpu().float(), ref_cache[0])
    assert torch.equal(vc_d.cpu().float(), ref_cache[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (6, 2), (16, 2)])  # GQA 1, 3 and 8
def test_decode_and_prefill_grid(heads, kv_heads, head_dim, block_size, dtype):
    # decodes whose contexts end mid-block, on a block edge and one past it; prompts from 0;
    # prefix hits and chunked-prefill continuations (start_pos > 0, mid-block too)
    seqs = [(0, 1), (16, 1), (32, 1), (40, 1), (100, 1),
            (0, 37), (0, 5), (32, 17), (21, 40), (5, 2)]
    compare(seqs, heads, kv_heads, head_dim, block_size, dtype, seed=head_dim + block_size)


@pytest.mark.parametrize("block_size", [1, 8, 64])
def test_other_block_sizes(block_size):
    # a key tile spans several blocks (1, 8) or lies inside one (64)
    compare([(3, 1), (70, 1), (0, 33), (18, 9)], 6, 2, 64, block_size, torch.float32, seed=7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window, softcap", [(5, None), (40, None), (None, 20.0), (12, 3.0)])
def test_window_and_softcap(window, softcap, dtype):
    seqs = [(0, 1), (30, 1), (90, 1), (0, 50), (33, 20), (7, 3)]
    compare(seqs, 8, 2, 64, 16, dtype, seed=11, window=window, softcap=softcap)


def test_decode_from_window_first_block():
    """Sliding-window groups free blocks that left the window: a decode row's table then
    starts at the window's first block, at position decode_first_pos."""
    gen = torch.Generator().manual_seed(3)
    block_size, window, ctx = 16, 20, 75
    kc = torch.randn(12, block_size, 2, 64, generator=gen)
    vc = torch.randn(12, block_size, 2, 64, generator=gen)
    full_table = torch.tensor([3, 7, 1, 9, 4])  # positions 0..79
    first_block = (ctx - window) // block_size  # the window's first key lies in block 3
    q = torch.randn(1, 6, 64, generator=gen)
    ref_meta = AttentionMetadata(torch.zeros(0, dtype=torch.long), 1, full_table[None],
                                 torch.tensor([ctx]), [])
    ref = TorchAttentionBackend()._decode(q, kc, vc, ref_meta, 0.125, window)
    out = decode.paged_decode(q.to(DEVICE), kc.to(DEVICE), vc.to(DEVICE),
                              full_table[first_block:][None].to(DEVICE),
                              torch.tensor([ctx], device=DEVICE), 0.125,
                              first_pos=torch.tensor([first_block * block_size], device=DEVICE),
                              window=window)
    torch.testing.assert_close(out.cpu(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("splits", [1, 2, 3, 7])
def test_split_k_merges_exactly(splits):
    """Flash-decoding: any split count (splits that get no keys included) gives the result of
    one pass."""
    q, _, _, kc, vc, meta = make_case([(4, 1), (300, 1), (63, 1)], 8, 1, 128, 16,
                                      torch.float32, seed=5)
    args = (kc, vc, meta.decode_block_tables, meta.decode_context_lens, 128**-0.5)
    ref = TorchAttentionBackend()._decode(q, *args[:2], meta, 128**-0.5)
    out = decode.paged_decode(q.to(DEVICE), *(a.to(DEVICE) for a in args[:4]), args[4],
                              splits=splits)
    torch.testing.assert_close(out.cpu(), ref, atol=1e-5, rtol=1e-5)
    assert decode.num_splits(100) == 1 and decode.num_splits(4096) == 8
    assert decode.num_splits(10**6) == decode.MAX_SPLITS


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_skips_negative_slots(dtype):
    """reshape_and_cache: rows of a fused qkv buffer (strided) land at their slots; slot -1
    (a padded row of a CUDA-graph batch) writes nothing."""
    gen = torch.Generator().manual_seed(1)
    qkv = torch.randn(5, 3 * 2 * 16, generator=gen).to(dtype)
    k = qkv[:, 32:64].view(5, 2, 16)
    v = qkv[:, 64:96].view(5, 2, 16)
    slots = torch.tensor([9, 0, -1, 31, 17])
    kc = torch.zeros(4, 8, 2, 16, dtype=dtype)
    vc = torch.zeros_like(kc)
    ref_k, ref_v = kc.clone(), vc.clone()
    keep = slots >= 0
    torch_write_kv(k[keep], v[keep], ref_k, ref_v, slots[keep])
    kc_d, vc_d = kc.to(DEVICE), vc.to(DEVICE)
    cache_ops.write_kv(k.to(DEVICE), v.to(DEVICE), kc_d, vc_d, slots.to(DEVICE))
    assert torch.equal(kc_d.cpu(), ref_k) and torch.equal(vc_d.cpu(), ref_v)


def test_copy_blocks_matches_indexing():
    """Copy-on-write: every layer slot's K and V of each src block over its dst, one launch."""
    gen = torch.Generator().manual_seed(2)
    cache = torch.randn(3, 2, 10, 16, 2, 8, generator=gen)
    pairs = [(1, 4), (7, 2), (1, 9)]
    ref = cache.clone()
    src, dst = torch.tensor(pairs).T
    ref[:, :, dst] = ref[:, :, src]
    got = cache.to(DEVICE)
    cache_ops.copy_blocks(got, torch.tensor(pairs, device=DEVICE))
    assert torch.equal(got.cpu(), ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden", [64, 96, 576])
def test_rms_norm_and_residual(dtype, hidden):
    gen = torch.Generator().manual_seed(hidden)
    x = torch.randn(7, hidden, generator=gen).to(dtype)
    res = torch.randn(7, hidden, generator=gen).to(dtype)
    norm = RMSNorm(hidden, 1e-5)
    norm.weight.data = torch.randn(hidden, generator=gen)
    norm = norm.to(dtype)
    ops = TritonFusedOps()
    w = norm.weight.data
    torch.testing.assert_close(ops.rms_norm(x.to(DEVICE), w.to(DEVICE), 1e-5).cpu(), norm(x),
                               atol=TOL[dtype], rtol=TOL[dtype])
    ref_res = res.clone()
    ref = norm.add_forward(x, ref_res)
    got_res = res.to(DEVICE)
    got = ops.add_rms_norm_(x.to(DEVICE), got_res, w.to(DEVICE), 1e-5)
    if dtype == torch.float32:
        assert torch.equal(got_res.cpu(), ref_res)  # the residual add is torch's
    else:  # the interpreter rounds toward zero (see the module doc)
        torch.testing.assert_close(got_res.cpu(), ref_res, atol=0, rtol=2**-7)
    torch.testing.assert_close(got.cpu(), ref, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_rope_in_place(dtype, head_dim):
    gen = torch.Generator().manual_seed(head_dim)
    heads, kv_heads, tokens = 6, 2, 9
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    angles = torch.rand(tokens, head_dim // 2, generator=gen) * 50
    emb = torch.cat((angles, angles), -1)
    cos, sin = emb.cos(), emb.sin()
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    c, s = cos.to(dtype)[:, None], sin.to(dtype)[:, None]
    ref_q, ref_k = apply_rope(q, c, s), apply_rope(k, c, s)
    got = qkv.to(DEVICE)
    TritonFusedOps.rope_(got, cos.to(DEVICE), sin.to(DEVICE), heads, kv_heads, head_dim)
    got = got.cpu()
    torch.testing.assert_close(got[:, : heads * head_dim].view_as(q), ref_q,
                               atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(got[:, heads * head_dim : (heads + kv_heads) * head_dim]
                               .view_as(k), ref_k, atol=TOL[dtype], rtol=TOL[dtype])
    assert torch.equal(got[:, (heads + kv_heads) * head_dim :],
                       qkv[:, (heads + kv_heads) * head_dim :])  # v untouched


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul(dtype):
    gen = torch.Generator().manual_seed(4)
    gate_up = torch.randn(5, 2 * 1536, generator=gen).to(dtype) * 3
    gate, up = gate_up.split(1536, -1)
    ref = torch.nn.functional.silu(gate) * up
    got = TritonFusedOps.silu_and_mul(gate_up.to(DEVICE)).cpu()
    torch.testing.assert_close(got, ref, atol=TOL[dtype], rtol=TOL[dtype])
