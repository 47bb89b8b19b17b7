"""Paged decode attention in Triton: one query token per sequence, K/V read in place through the
block tables, split along the context (flash-decoding) and reduced in a second pass.

Pass 1 runs one program per (sequence, KV head, split). The program loads the queries of the
whole GQA group of that KV head as one [BLOCK_H, head_dim] tile (padded to 16 rows so `tl.dot`
takes it), walks its split of the context BLOCK_N keys at a time (each key's slot found through
the block table, so any block size works and a tile may span blocks), and keeps an online
softmax: it writes its normalised partial output and its log-sum-exp. K/V are read once per
group, never repeated per query head. Pass 2 runs one program per (sequence, head) and merges
the splits by their log-sum-exp.

Masks: key position p (the table's first entry sits at `first_pos`, non-zero for sliding-window
groups whose tables start at the window) is seen when p < context_len, and with a window when
p >= context_len - window. `softcap`: scores become tanh(s / cap) * cap (Gemma 2).

Quantized pages (kv_quant.py, KV_KIND 1 int8 / 2 fp8): each K/V tile is widened and scaled as
it is loaded (an int8 row's scale from the float32 view of the cache at the row's end, fp8's
per-head scale), then multiplied in fp32 (the interpreter) or in the query's dtype.

The number of splits comes from the padded table width (an upper bound of every context of the
batch known without reading the device), so a CUDA graph captured for a width replays with the
same grid.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from octavo.model.kernels.triton import check_device, interpreted, jit

SPLIT_TOKENS = 512  # context per split before another split is added
MAX_SPLITS = 16


@jit
def dequant_tile(x, scale_ptr, off, row_mask, kvh, HEAD_DIM: tl.constexpr,
                 KV_KIND: tl.constexpr):
    """A tile of stored K or V rows [rows, d] as fp32 values: int8 rows times their scale
    (fp32, after the row's values: at (off + HEAD_DIM) / 4 in the cache's float32 view), fp8
    times the KV head's scale."""
    if KV_KIND == 1:
        s = tl.load(scale_ptr + (off + HEAD_DIM) // 4, mask=row_mask, other=0.0)
        return x.to(tl.float32) * s[:, None]
    return x.to(tl.float32) * tl.load(scale_ptr + kvh)


@jit
def _decode_split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, tables_ptr, ctx_lens_ptr, first_pos_ptr,
    part_out_ptr, part_lse_ptr,
    stride_qb, stride_qh,
    stride_cb, stride_cs, stride_ch,
    stride_tb,
    stride_pb, stride_ph, stride_ps, stride_lb,
    scale, softcap, window, k_scale_ptr, v_scale_ptr,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    NUM_SPLITS: tl.constexpr, HAS_FIRST_POS: tl.constexpr, USE_SOFTCAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr, KV_KIND: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(ctx_lens_ptr + b).to(tl.int32)
    first = tl.zeros((), dtype=tl.int32)
    if HAS_FIRST_POS:
        first = tl.load(first_pos_ptr + b).to(tl.int32)
    n_keys = ctx - first  # table entries in use
    lo = tl.zeros((), dtype=tl.int32)
    if window > 0:
        lo = tl.maximum(ctx - window - first, 0)
    per_split = tl.cdiv(tl.cdiv(n_keys - lo, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = lo + split * per_split
    end = tl.minimum(start + per_split, n_keys)

    rows = tl.arange(0, BLOCK_H)
    row_mask = rows < GROUP
    heads = kvh * GROUP + rows
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
                mask=row_mask[:, None] & d_mask[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    for n0 in range(start, end, BLOCK_N):
        t = n0 + tl.arange(0, BLOCK_N)
        t_mask = t < end
        block = tl.load(tables_ptr + b * stride_tb + t // BLOCK_SIZE, mask=t_mask, other=0)
        off = block.to(tl.int64) * stride_cb + (t % BLOCK_SIZE) * stride_cs + kvh * stride_ch
        kv_mask = t_mask[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + off[:, None] + d[None, :], mask=kv_mask, other=0.0)
        if KV_KIND != 0:
            k = dequant_tile(k, k_scale_ptr, off, t_mask, kvh, HEAD_DIM, KV_KIND).to(q.dtype)
        if UPCAST:
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale
        if USE_SOFTCAP:  # tanh(s / cap) * cap, tanh from exp (stable at both ends)
            s = (1.0 - 2.0 / (tl.exp(2.0 * s / softcap) + 1.0)) * softcap
        s = tl.where(t_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        v = tl.load(v_cache_ptr + off[:, None] + d[None, :], mask=kv_mask, other=0.0)
        if KV_KIND != 0:
            v = dequant_tile(v, v_scale_ptr, off, t_mask, kvh, HEAD_DIM, KV_KIND).to(q.dtype)
        pv = p.to(v.dtype)  # p rounded to the model dtype, as FlashAttention does
        if UPCAST:
            pv, v = pv.to(tl.float32), v.to(tl.float32)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(pv, v, input_precision=DOT_PRECISION)
        m_i = m_new

    has = l_i > 0
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    if NUM_SPLITS == 1:  # one pass: the output itself (part_out is the output tensor)
        tl.store(part_out_ptr + b * stride_pb + heads[:, None] * stride_ph + d[None, :],
                 out.to(part_out_ptr.dtype.element_ty), mask=row_mask[:, None] & d_mask[None, :])
    else:
        lse = tl.where(has, m_i + tl.log(tl.where(has, l_i, 1.0)), float("-inf"))
        base = b * stride_pb + heads * stride_ph + split * stride_ps
        tl.store(part_out_ptr + base[:, None] + d[None, :], out,
                 mask=row_mask[:, None] & d_mask[None, :])
        tl.store(part_lse_ptr + b * stride_lb + heads * NUM_SPLITS + split, lse,
                 mask=row_mask)


@jit
def _decode_reduce_kernel(
    part_out_ptr, part_lse_ptr, out_ptr,
    stride_pb, stride_ph, stride_ps, stride_ob, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr, NUM_HEADS: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    s_mask = s < NUM_SPLITS
    lse = tl.load(part_lse_ptr + (b * NUM_HEADS + h) * NUM_SPLITS + s, mask=s_mask,
                  other=float("-inf"))
    m = tl.max(lse, 0)
    w = tl.where(s_mask & (lse > float("-inf")), tl.exp(lse - m), 0.0)
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    parts = tl.load(part_out_ptr + b * stride_pb + h * stride_ph + s[:, None] * stride_ps
                    + d[None, :], mask=s_mask[:, None] & d_mask[None, :], other=0.0)
    o = tl.sum(parts * w[:, None], 0) / tl.sum(w, 0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + d, o.to(out_ptr.dtype.element_ty),
             mask=d_mask)


def num_splits(max_len: int) -> int:
    return max(1, min(MAX_SPLITS, triton.cdiv(max_len, SPLIT_TOKENS)))


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 tiles multiply in full precision (Triton's default on NVIDIA is TF32); 16-bit
    tiles natively, except in the interpreter, which multiplies bf16 tiles as raw integers:
    there the kernels widen them to fp32 first (UPCAST)."""
    return "ieee" if dtype == torch.float32 else "tf32"


def scale_views(k_cache: torch.Tensor, v_cache: torch.Tensor, kv
                ) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """For a kernel reading `kv`'s pages (kv_quant.KVQuant; None: the model dtype): the K and
    V scale pointers (int8: each cache's float32 view, the scales sit at the rows' ends; fp8:
    the per-head scales; none: unused), KV_KIND, and the scale elements after each row."""
    if kv is None:
        return k_cache, v_cache, 0, 0
    if kv.fmt.name == "int8":
        return (k_cache.view(torch.uint8).view(torch.float32),
                v_cache.view(torch.uint8).view(torch.float32), 1, kv.fmt.scale_bytes)
    return kv.k_scale, kv.v_scale, 2, 0


def paged_decode(
    q: torch.Tensor,  # [B, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, width] block ids
    context_lens: torch.Tensor,  # [B]
    scale: float,
    first_pos: torch.Tensor | None = None,  # [B] position of each table's first entry
    window: int = 0,
    softcap: float = 0.0,
    out: torch.Tensor | None = None,
    splits: int | None = None,
    kv=None,  # kv_quant.KVQuant: the caches hold quantized rows
) -> torch.Tensor:
    check_device(q)
    batch, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    k_scale, v_scale, kv_kind, extra = scale_views(k_cache, v_cache, kv)
    assert k_cache.shape[3] == head_dim + extra
    group = num_heads // num_kv_heads
    assert k_cache.stride(3) == 1 and q.stride(2) == 1, "head_dim must be contiguous"
    if out is None:
        out = torch.empty_like(q)
    if batch == 0:
        return out
    width = block_tables.shape[1]
    splits = splits or num_splits(width * block_size)
    block_d = triton.next_power_of_2(head_dim)
    if splits == 1:  # one pass writes the output; no partials, no reduce
        assert out.stride(2) == 1
        part_out, part_lse = out, out
        part_strides = (out.stride(0), out.stride(1), 0, 0)
    else:
        part_out = torch.empty(batch, num_heads, splits, block_d, dtype=torch.float32,
                               device=q.device)
        part_lse = torch.empty(batch, num_heads, splits, dtype=torch.float32, device=q.device)
        part_strides = (*part_out.stride()[:3], part_lse.stride(0))
    # keys per tile: a block (16..64) on a GPU; more in the interpreter, whose cost is per op
    block_n = 128 if interpreted() else max(16, min(64, triton.next_power_of_2(block_size)))
    _decode_split_kernel[(batch, num_kv_heads, splits)](
        q, k_cache, v_cache, block_tables, context_lens,
        first_pos if first_pos is not None else context_lens,
        part_out, part_lse,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0),
        *part_strides,
        scale, softcap if softcap else 1.0, window, k_scale, v_scale,
        GROUP=group, HEAD_DIM=head_dim, BLOCK_D=block_d,
        BLOCK_H=max(16, triton.next_power_of_2(group)), BLOCK_N=block_n, BLOCK_SIZE=block_size,
        NUM_SPLITS=splits, HAS_FIRST_POS=first_pos is not None, USE_SOFTCAP=bool(softcap),
        DOT_PRECISION=dot_precision(q.dtype),
        UPCAST=interpreted() and q.dtype != torch.float32, KV_KIND=kv_kind,
    )
    if splits == 1:
        return out
    _decode_reduce_kernel[(batch, num_heads)](
        part_out, part_lse, out,
        part_out.stride(0), part_out.stride(1), part_out.stride(2), out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, BLOCK_D=block_d, NUM_SPLITS=splits,
        BLOCK_S=triton.next_power_of_2(splits), NUM_HEADS=num_heads,
    )
    return out
