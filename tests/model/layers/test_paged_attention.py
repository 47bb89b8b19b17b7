"""Paged attention equals dense causal attention, however the blocks are laid out."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from octavo.model.kernels.cpu_isa import cpu_flags, supported_isas
from octavo.model.layers.attention import get_backend
from octavo.model.layers.attention.base import AttentionMetadata, PrefillChunk
from tests.conftest import TEST_DEVICE

# every build of the compiled kernel this CPU can run (avx512, avx2, portable: best first)
ISAS = supported_isas()

HEADS, KV_HEADS, DIM = 4, 2, 16


def dense_reference(q, k, v, start_pos: int) -> torch.Tensor:
    """q: [n, h, d] for positions start_pos..; k, v: [ctx, kvh, d] for positions 0..ctx-1."""
    n, ctx = q.shape[0], k.shape[0]
    rep = HEADS // KV_HEADS
    kk = k.repeat_interleave(rep, dim=1).transpose(0, 1)
    vv = v.repeat_interleave(rep, dim=1).transpose(0, 1)
    mask = torch.arange(ctx)[None, :] <= torch.arange(start_pos, start_pos + n)[:, None]
    o = F.scaled_dot_product_attention(q.transpose(0, 1), kk, vv, attn_mask=mask)
    return o.transpose(0, 1)


def step_meta(slots: list[int], tables: list[list[int]], decodes: list[int],
              decode_lens: list[int], prefills: list[PrefillChunk]) -> AttentionMetadata:
    """A step's metadata from plain lists: `decodes` index `tables` (padded to one width)."""
    width = max((len(tables[i]) for i in decodes), default=0)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        num_decodes=len(decodes),
        decode_block_tables=torch.tensor([tables[i] + [0] * (width - len(tables[i]))
                                          for i in decodes]) if decodes else None,
        decode_context_lens=torch.tensor(decode_lens) if decodes else None,
        prefills=prefills,
    )


class OnDevice:
    """A backend run on the tests' device (tests/conftest.py) for CPU callers: the inputs go
    there, the output and the caches (written in place) come back."""

    def __init__(self, backend) -> None:
        self.backend = backend

    def forward(self, q, k, v, k_cache, v_cache, meta, scale, *args):
        def to(t):
            return None if t is None else t.to(TEST_DEVICE)

        meta = AttentionMetadata(
            to(meta.slot_mapping), meta.num_decodes, to(meta.decode_block_tables),
            to(meta.decode_context_lens),
            [PrefillChunk(c.query_start, c.query_end, c.start_pos, to(c.block_table))
             for c in meta.prefills], to(meta.decode_first_pos))
        kc, vc = to(k_cache), to(v_cache)
        out = self.backend.forward(to(q), to(k), to(v), kc, vc, meta, scale, *args)
        k_cache.copy_(kc.cpu())
        v_cache.copy_(vc.cpu())
        return out.cpu()


# triton: octavo's Triton kernels (the GPU backend), on the tests' device: in Triton's
# interpreter on CPU
@pytest.fixture(params=["torch", *(f"cpu-{isa}" for isa in ISAS), "triton"])
def backend(request):
    name, _, isa = request.param.partition("-")
    if name == "triton":
        return OnDevice(get_backend(name, TEST_DEVICE))
    b = get_backend(name, torch.device("cpu"), isa or None)
    assert isa == "" or b.isa == isa
    return b


def run_case(backend, seqs: list[tuple[int, int]], block_size: int, seed: int) -> None:
    """seqs: (context already cached, new tokens) per sequence, in flat-batch order."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    num_blocks = sum(-(-(c + n) // block_size) for c, n in seqs) + 3
    k_cache = torch.zeros(num_blocks, block_size, KV_HEADS, DIM)
    v_cache = torch.zeros_like(k_cache)
    free = list(range(num_blocks))
    rng.shuffle(free)  # non-contiguous, out-of-order physical blocks
    full_k, full_v, tables = [], [], []
    for cached, new in seqs:
        ctx = cached + new
        tables.append([free.pop() for _ in range(-(-ctx // block_size))])
        full_k.append(torch.randn(ctx, KV_HEADS, DIM, generator=gen))
        full_v.append(torch.randn(ctx, KV_HEADS, DIM, generator=gen))
        # the cached prefix is already in the paged cache
        for p in range(cached):
            b, o = tables[-1][p // block_size], p % block_size
            k_cache[b, o], v_cache[b, o] = full_k[-1][p], full_v[-1][p]
    order = sorted(range(len(seqs)), key=lambda i: seqs[i][1] > 1)  # decodes first
    qs, ks, vs, slots, prefills = [], [], [], [], []
    row = 0
    decodes = [i for i in order if seqs[i][1] == 1]
    for i in order:
        cached, new = seqs[i]
        q = torch.randn(new, HEADS, DIM, generator=gen)
        qs.append(q)
        ks.append(full_k[i][cached:])
        vs.append(full_v[i][cached:])
        for p in range(cached, cached + new):
            slots.append(tables[i][p // block_size] * block_size + p % block_size)
        if new > 1:
            prefills.append(PrefillChunk(row, row + new, cached, torch.tensor(tables[i])))
        row += new
    meta = step_meta(slots, tables, decodes, [sum(seqs[i]) for i in decodes], prefills)
    out = backend.forward(
        torch.cat(qs), torch.cat(ks), torch.cat(vs), k_cache, v_cache, meta, DIM**-0.5
    )
    row = 0
    for j, i in enumerate(order):
        cached, new = seqs[i]
        ref = dense_reference(qs[j], full_k[i], full_v[i], cached)
        torch.testing.assert_close(out[row : row + new], ref, atol=1e-5, rtol=1e-5)
        row += new
    # the new K/V landed exactly at the slot mapping
    flat_k = k_cache.view(-1, KV_HEADS, DIM)
    torch.testing.assert_close(flat_k[torch.tensor(slots)], torch.cat(ks))


@pytest.mark.parametrize("block_size", [1, 16, 256])
def test_prefill_from_zero(backend, block_size):
    run_case(backend, [(0, 37), (0, 5), (0, 300)], block_size, seed=1)


@pytest.mark.parametrize("block_size", [1, 8, 16, 32])
def test_prefill_from_offset(backend, block_size):
    # a prefix-cache hit or a later chunk of a long prompt: the first blocks already hold K/V
    run_case(backend, [(32, 17), (48, 64), (5, 3)], block_size, seed=2)


@pytest.mark.parametrize("block_size", [1, 16, 64])
def test_decode_batch(backend, block_size):
    run_case(backend, [(10, 1), (1, 1), (100, 1), (63, 1), (64, 1)], block_size, seed=3)


@pytest.mark.parametrize("block_size", [1, 16, 128])
def test_mixed_prefill_decode(backend, block_size):
    run_case(backend, [(40, 1), (0, 50), (7, 1), (16, 30), (0, 2), (99, 1)], block_size, seed=4)


@pytest.mark.parametrize("isa", ISAS)
def test_decode_kernel_bfloat16_matches_reference(isa):
    kernel_backend = get_backend("cpu", torch.device("cpu"), isa)
    gen = torch.Generator().manual_seed(5)
    k_cache = torch.randn(6, 16, KV_HEADS, DIM, generator=gen).bfloat16()
    v_cache = torch.randn(6, 16, KV_HEADS, DIM, generator=gen).bfloat16()
    q = torch.randn(2, HEADS, DIM, generator=gen).bfloat16()
    tables = torch.tensor([[4, 1, 0], [2, 5, 3]])
    lens = torch.tensor([20, 40])
    meta = AttentionMetadata(torch.zeros(0, dtype=torch.long), 2, tables, lens, [])
    out = kernel_backend._decode(q, k_cache, v_cache, meta, DIM**-0.5)
    for b in range(2):
        keys = k_cache[tables[b]].flatten(0, 1)[: lens[b]].float()
        values = v_cache[tables[b]].flatten(0, 1)[: lens[b]].float()
        ref = dense_reference(q[b : b + 1].float(), keys, values, lens[b].item() - 1)
        torch.testing.assert_close(out[b].float(), ref[0], atol=2e-2, rtol=2e-2)


def _random_decode(gen, lens, heads, kv_heads, head_dim, block_size, dtype=torch.float32,
                   q_scale=3.0):
    """q and K/V caches whose blocks are shuffled through the pool, and the tables to them."""
    nblocks = [-(-n // block_size) for n in lens]
    num_blocks = sum(nblocks) + 1
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables = []
    for nb in nblocks:
        tables.append(perm[:nb] + [0] * (max(nblocks) - nb))
        perm = perm[nb:]
    q = (torch.randn(len(lens), heads, head_dim, generator=gen) * q_scale).to(dtype)
    return q, k_cache, v_cache, torch.tensor(tables), torch.tensor(lens)


@pytest.mark.parametrize("head_dim", [16, 64, 128, 256])
@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("isa", ISAS)
def test_decode_kernel_head_dims_and_long_contexts(head_dim, block_size, dtype, isa):
    """The kernel's unrolled paths (head_dim 64 and 128, 16 or 8 keys at a time) and its
    generic path, over contexts that end mid-chunk, with peaked scores that make the running
    max move, on every ISA build this CPU runs."""
    kernel_backend = get_backend("cpu", torch.device("cpu"), isa)
    gen = torch.Generator().manual_seed(head_dim + block_size)
    heads, kv_heads = 9, 3
    lens = [1, 15, 16, 17, 100, 333]
    q, k_cache, v_cache, tables, ctx = _random_decode(gen, lens, heads, kv_heads, head_dim,
                                                      block_size, dtype, q_scale=4.0)
    meta = AttentionMetadata(torch.zeros(0, dtype=torch.long), len(lens), tables, ctx, [])
    scale = head_dim**-0.5
    out = kernel_backend._decode(q, k_cache, v_cache, meta, scale)
    for b, n in enumerate(lens):
        keys = k_cache[tables[b]].flatten(0, 1)[:n].float()
        values = v_cache[tables[b]].flatten(0, 1)[:n].float()
        rep = heads // kv_heads
        ref = F.scaled_dot_product_attention(
            q[b].float()[:, None, :], keys.repeat_interleave(rep, 1).transpose(0, 1),
            values.repeat_interleave(rep, 1).transpose(0, 1), scale=scale)[:, 0, :]
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(out[b].float(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("group", [1, 2, 4, 5, 8, 20])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("isa", ISAS)
def test_decode_kernel_gqa_group_sizes(group, head_dim, isa):
    """Query heads per KV head from 1 (MHA) to 20: the AVX-512 kernel reads each V row once
    for up to 4 (head_dim 64), 2 (128) or 1 (256) heads of a group and scores 16 heads per
    pass, so groups that are not multiples of those take its remainder passes."""
    kernel = get_backend("cpu", torch.device("cpu"), isa).kernel
    gen = torch.Generator().manual_seed(group * 1000 + head_dim)
    kv_heads = 2
    heads = group * kv_heads
    lens = [3, 16, 41]
    q, k_cache, v_cache, tables, ctx = _random_decode(gen, lens, heads, kv_heads, head_dim, 16)
    out = kernel.paged_decode(q, k_cache, v_cache, tables, ctx, head_dim**-0.5)
    for b, n in enumerate(lens):
        keys = k_cache[tables[b]].flatten(0, 1)[:n]
        values = v_cache[tables[b]].flatten(0, 1)[:n]
        ref = F.scaled_dot_product_attention(
            q[b][:, None, :], keys.repeat_interleave(group, 1).transpose(0, 1),
            values.repeat_interleave(group, 1).transpose(0, 1), scale=head_dim**-0.5)[:, 0, :]
        torch.testing.assert_close(out[b], ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("isa", ISAS)
def test_decode_kernel_result_independent_of_batch_and_threads(isa):
    """The kernel hands sequences to threads longest first, as each thread frees up: a
    sequence's output is bit-identical alone, in any batch order and on 1 or 2 threads."""
    kernel = get_backend("cpu", torch.device("cpu"), isa).kernel
    gen = torch.Generator().manual_seed(7)
    lens = [5, 300, 17, 129, 64, 1, 250]
    q, k_cache, v_cache, tables, ctx = _random_decode(gen, lens, 9, 3, 64, 16)
    threads = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 2):
            torch.set_num_threads(n)
            outs.append(kernel.paged_decode(q, k_cache, v_cache, tables, ctx, 0.125))
        order = torch.randperm(len(lens), generator=gen)
        shuffled = kernel.paged_decode(q[order], k_cache, v_cache, tables[order], ctx[order],
                                       0.125)
        alone = [kernel.paged_decode(q[b:b + 1], k_cache, v_cache, tables[b:b + 1],
                                     ctx[b:b + 1], 0.125) for b in range(len(lens))]
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outs[0], outs[1])
    assert torch.equal(shuffled, outs[0][order])
    assert torch.equal(torch.cat(alone), outs[0])


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_heads, group, head_dim", [(3, 3, 64), (8, 4, 128), (1, 8, 64),
                                                       (5, 1, 48)])
def test_decode_kernel_splits_kv_heads_when_threads_outnumber_sequences(
        isa, dtype, kv_heads, group, head_dim):
    """With fewer sequences than threads (batch 1 on a multi-core CPU) each sequence's KV heads
    are split over the threads: the output is bit-identical to one thread's, for uneven splits
    (3 KV heads on 2 threads), more threads than heads, sliding windows and soft caps."""
    kernel = get_backend("cpu", torch.device("cpu"), isa).kernel
    gen = torch.Generator().manual_seed(kv_heads * 100 + group)
    lens = [300, 41]
    q, k_cache, v_cache, tables, ctx = _random_decode(gen, lens, kv_heads * group, kv_heads,
                                                      head_dim, 16, dtype)
    first = torch.zeros(len(lens), dtype=torch.long)
    threads = torch.get_num_threads()
    try:
        results = {}
        for n in (1, 2, 3, 8):
            torch.set_num_threads(n)
            for b in range(len(lens)):
                one = (q[b:b + 1], k_cache, v_cache, tables[b:b + 1], ctx[b:b + 1], 0.125)
                results[n, b] = (kernel.paged_decode(*one),
                                 kernel.paged_decode(*one, first[b:b + 1], 100, 30.0))
            results[n, "both"] = kernel.paged_decode(q, k_cache, v_cache, tables, ctx, 0.125)
    finally:
        torch.set_num_threads(threads)
    for (n, b), out in results.items():
        if b == "both":
            assert torch.equal(out, results[1, "both"]), n
        else:
            assert torch.equal(out[0], results[1, b][0]), (n, b)
            assert torch.equal(out[1], results[1, b][1]), (n, b)
            assert torch.equal(out[0][0], results[1, "both"][b]), (n, b)


@pytest.mark.parametrize("length", [1, 7, 300])
def test_bf16_eager_prefill_matches_fp32_reference(length):
    from octavo.model.layers.attention.torch_backend import eager_causal

    gen = torch.Generator().manual_seed(length)
    q = torch.randn(length, 9, 64, generator=gen)
    k = torch.randn(length, 3, 64, generator=gen)
    v = torch.randn(length, 3, 64, generator=gen)
    ref = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.repeat_interleave(3, 1).transpose(0, 1),
        v.repeat_interleave(3, 1).transpose(0, 1), is_causal=True, scale=0.125).transpose(0, 1)
    torch.testing.assert_close(eager_causal(q, k, v, 0.125), ref, atol=1e-5, rtol=1e-5)
    got = eager_causal(q.bfloat16(), k.bfloat16(), v.bfloat16(), 0.125).float()
    torch.testing.assert_close(got, ref, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("head_dim", [16, 64, 256])
@pytest.mark.parametrize("window, softcap, trimmed",
                         [(5, None, False), (37, None, True), (None, 20.0, False),
                          (12, 3.0, True)])
def test_decode_kernel_window_and_softcap(isa, head_dim, window, softcap, trimmed):
    """Sliding-window decode (table from the window's first block, decode_first_pos) and soft
    caps in the kernel equal torch's masked path, on every ISA build."""
    from octavo.model.layers.attention.torch_backend import TorchAttentionBackend

    kernel_backend = get_backend("cpu", torch.device("cpu"), isa)
    gen = torch.Generator().manual_seed(head_dim + (window or 0))
    heads, kv_heads, block_size = 6, 2, 8
    lens = [1, 7, 8, 9, 40, 101]
    num_blocks = sum(-(-n // block_size) for n in lens) + 2
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, first = [], []
    for n in lens:
        nb = -(-n // block_size)
        table, perm = perm[:nb], perm[nb:]
        # a trimmed table starts at the block of the window's first key
        lo = max(0, n - window) // block_size if trimmed and window else 0
        tables.append(table[lo:])
        first.append(lo * block_size)
    width = max(len(t) for t in tables)
    meta = AttentionMetadata(
        torch.zeros(0, dtype=torch.long), len(lens),
        torch.tensor([t + [0] * (width - len(t)) for t in tables]), torch.tensor(lens), [],
        decode_first_pos=torch.tensor(first) if trimmed else None)
    q = torch.randn(len(lens), heads, head_dim, generator=gen) * 3
    scale = head_dim**-0.5
    got = kernel_backend._decode(q, k_cache, v_cache, meta, scale, window, softcap)
    want = TorchAttentionBackend._decode(q, k_cache, v_cache, meta, scale, window, softcap)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


PREFILL_SHAPES = [  # head_dim, block_size, heads, kv_heads (GQA 1, 3, 8, 4; head_dim 40: not
    # a multiple of 16, the bf16-dot V packing's tail)
    (16, 1, 4, 4), (64, 16, 9, 3), (128, 32, 8, 1), (256, 16, 8, 2), (40, 16, 8, 2)]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", PREFILL_SHAPES, ids=lambda s: "d{}-bs{}-h{}-kv{}".format(*s))
@pytest.mark.parametrize("window, softcap", [(None, None), (13, None), (None, 20.0), (40, 5.0)])
def test_prefill_kernel_equals_torch_on_every_build(isa, dtype, shape, window, softcap):
    """Every prefill chunk of a step in one paged_prefill call equals the torch backend's
    per-chunk attention: prompts from 0, prefix hits and later chunks (contexts ending
    mid-block), one-token and multi-tile chunks, q strided inside a fused qkv buffer, windows
    and soft caps; every ISA build this CPU runs, the portable one included, and bf16 both
    widened to fp32 and in bf16 dot products."""
    from octavo.model.layers.attention.base import prefill_batch
    from octavo.model.layers.attention.torch_backend import TorchAttentionBackend

    head_dim, block_size, heads, kv_heads = shape
    ops = get_backend("cpu", torch.device("cpu"), isa).kernel
    # bf16 takes the CPU's bf16 dot products on the AVX-512 build where it has them
    assert ops.prefill_bf16_dot() == (isa == "avx512" and "avx512_bf16" in cpu_flags())
    gen = torch.Generator().manual_seed(head_dim + block_size + (window or 0))
    chunks = [(0, 37), (13, 5), (100, 1), (3, 64), (48, 33), (0, 2)]  # (cached, new)
    nblocks = [-(-(c + n) // block_size) for c, n in chunks]
    num_blocks = sum(nblocks) + 3
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    prefills, row = [], 0
    for (cached, new), nb in zip(chunks, nblocks, strict=True):
        table, perm = perm[:nb], perm[nb:]
        prefills.append(PrefillChunk(row, row + new, cached, torch.tensor(table)))
        row += new
    qkv = torch.randn(row, heads + 2 * kv_heads, head_dim, generator=gen) * 3
    q = qkv.to(dtype)[:, :heads]  # strided rows, as the model hands q over
    meta = AttentionMetadata(torch.zeros(0, dtype=torch.long), 0, None, None, prefills)
    tables, query_start, start_pos = prefill_batch(meta)
    scale = head_dim**-0.5
    got = ops.paged_prefill(q, k_cache.to(dtype), v_cache.to(dtype), tables, query_start,
                            start_pos, scale, window or 0, softcap or 0.0)
    # the reference: the torch backend on fp32 copies, the K/V already in the cache
    torch_backend = TorchAttentionBackend()
    fp32 = q.float().contiguous()
    want = torch.empty_like(fp32)
    for p in prefills:  # one chunk at a time: the torch path takes a chunk's new K/V from k, v
        n = p.query_end - p.query_start
        ctx = torch.arange(p.start_pos, p.start_pos + n)
        slots = p.block_table[ctx // block_size] * block_size + ctx % block_size
        k_new = k_cache.to(dtype).float().view(-1, kv_heads, head_dim)[slots]
        v_new = v_cache.to(dtype).float().view(-1, kv_heads, head_dim)[slots]
        one = AttentionMetadata(slots, 0, None, None,
                                [PrefillChunk(0, n, p.start_pos, p.block_table)])
        want[p.query_start : p.query_end] = torch_backend.forward(
            fp32[p.query_start : p.query_end], k_new, v_new, k_cache.to(dtype).float(),
            v_cache.to(dtype).float(), one, scale, window, softcap)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)
    if dtype == torch.bfloat16:  # the other bf16 flavour: widened to fp32 / bf16 dot products
        other = ops.paged_prefill(q, k_cache.to(dtype), v_cache.to(dtype), tables, query_start,
                                  start_pos, scale, window or 0, softcap or 0.0, bf16_dot=False)
        torch.testing.assert_close(other.float(), want, atol=tol, rtol=tol)
