"""Paged prefill/extend attention in Triton: every prefill chunk of the step in one launch.

A chunk is a run of new tokens of one sequence (a prompt, a chunked-prefill continuation, a
prompt whose first blocks came from the prefix cache, a speculative verification chunk). Its
queries attend to every earlier key of the sequence and causally to the chunk's own, all read
from the paged cache through the chunk's block table (the step's K/V were written there first),
so a prefix hit costs no copy and chunks of any lengths share the launch (varlen: rows of the
flat batch located by `query_start`).

One program per (chunk, query head, BLOCK_M query rows) with an online softmax over BLOCK_N
keys at a time; key slots come from the block table per key, so any block size works. The
queries of a GQA group read their KV head (no repeated K/V in memory). Programs whose rows lie
past their chunk's end return at once, so the grid is sized by the longest chunk. Quantized
pages are widened and scaled tile by tile as decode.py does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from octavo.model.kernels.triton import check_device, interpreted, jit
from octavo.model.kernels.triton.decode import dequant_tile, dot_precision, scale_views


@jit
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, tables_ptr, query_start_ptr, start_pos_ptr,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cb, stride_cs, stride_ch, stride_tb,
    scale, softcap, window, k_scale_ptr, v_scale_ptr,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    USE_SOFTCAP: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    KV_KIND: tl.constexpr,
):
    c = tl.program_id(0)
    h = tl.program_id(1)
    mt = tl.program_id(2)
    q0 = tl.load(query_start_ptr + c).to(tl.int32)
    qlen = tl.load(query_start_ptr + c + 1).to(tl.int32) - q0
    if mt * BLOCK_M >= qlen:
        return
    start = tl.load(start_pos_ptr + c).to(tl.int32)
    kvh = h // GROUP
    m = mt * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = m < qlen
    q_pos = start + m
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    q = tl.load(q_ptr + (q0 + m)[:, None] * stride_qt + h * stride_qh + d[None, :],
                mask=m_mask[:, None] & d_mask[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    hi = start + tl.minimum(qlen, (mt + 1) * BLOCK_M)  # keys [lo, hi) can be seen
    lo = tl.zeros((), dtype=tl.int32)
    if window > 0:
        lo = tl.maximum(start + mt * BLOCK_M - window + 1, 0) // BLOCK_N * BLOCK_N
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        kp = n0 + tl.arange(0, BLOCK_N)
        k_mask = kp < hi
        block = tl.load(tables_ptr + c * stride_tb + kp // BLOCK_SIZE, mask=k_mask, other=0)
        off = block.to(tl.int64) * stride_cb + (kp % BLOCK_SIZE) * stride_cs + kvh * stride_ch
        kv_mask = k_mask[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + off[:, None] + d[None, :], mask=kv_mask, other=0.0)
        if KV_KIND != 0:
            k = dequant_tile(k, k_scale_ptr, off, k_mask, kvh, HEAD_DIM, KV_KIND).to(q.dtype)
        if UPCAST:
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale
        if USE_SOFTCAP:  # tanh(s / cap) * cap, tanh from exp (stable at both ends)
            s = (1.0 - 2.0 / (tl.exp(2.0 * s / softcap) + 1.0)) * softcap
        seen = k_mask[None, :] & (kp[None, :] <= q_pos[:, None])
        if window > 0:
            seen = seen & (kp[None, :] > q_pos[:, None] - window)
        s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # a row with nothing seen yet (a window's start lies ahead) keeps m = -inf: exp(-inf)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        v = tl.load(v_cache_ptr + off[:, None] + d[None, :], mask=kv_mask, other=0.0)
        if KV_KIND != 0:
            v = dequant_tile(v, v_scale_ptr, off, k_mask, kvh, HEAD_DIM, KV_KIND).to(q.dtype)
        pv = p.to(v.dtype)  # p rounded to the model dtype, as FlashAttention does
        if UPCAST:
            pv, v = pv.to(tl.float32), v.to(tl.float32)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(pv, v, input_precision=DOT_PRECISION)
        m_i = m_new

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + (q0 + m)[:, None] * stride_ot + h * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


def paged_prefill(
    q: torch.Tensor,  # [T, num_heads, head_dim]: the prefill rows of the step
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_chunks, width]
    query_start: torch.Tensor,  # [num_chunks + 1]: each chunk's first row in q
    start_pos: torch.Tensor,  # [num_chunks]: tokens of its sequence cached before the chunk
    max_query_len: int,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
    out: torch.Tensor | None = None,
    kv=None,  # kv_quant.KVQuant: the caches hold quantized rows
) -> torch.Tensor:
    check_device(q)
    _, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    k_scale, v_scale, kv_kind, extra = scale_views(k_cache, v_cache, kv)
    assert k_cache.shape[3] == head_dim + extra
    assert k_cache.stride(3) == 1 and q.stride(2) == 1, "head_dim must be contiguous"
    if out is None:
        out = torch.empty_like(q)
    num_chunks = block_tables.shape[0]
    if num_chunks == 0 or max_query_len == 0:
        return out
    block_m = 16 if max_query_len <= 16 else 32
    block_n = 32
    if interpreted():  # its cost is per op: fewer, larger tiles
        block_m, block_n = max(16, min(128, triton.next_power_of_2(max_query_len))), 128
    _prefill_kernel[(num_chunks, num_heads, triton.cdiv(max_query_len, block_m))](
        q, k_cache, v_cache, out, block_tables, query_start, start_pos,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        scale, softcap if softcap else 1.0, window, k_scale, v_scale,
        GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_SIZE=block_size, USE_SOFTCAP=bool(softcap), DOT_PRECISION=dot_precision(q.dtype),
        UPCAST=interpreted() and q.dtype != torch.float32, KV_KIND=kv_kind,
    )
    return out
