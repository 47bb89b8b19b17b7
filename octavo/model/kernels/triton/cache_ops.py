"""The paged cache's own kernels in Triton: the KV write and block copies.

`write_kv` (vLLM's reshape_and_cache): token t's K and V rows, every KV head, go to slot
`slot_mapping[t]` of the layer's cache (slot = block * block_size + offset); a negative slot
skips the token (the padded rows of a CUDA-graph batch). One program per token on a GPU.

With quantized pages (kv_quant.py) `write_kv` quantizes as it writes, per token and KV head,
with kv_quant's arithmetic: int8 rows get their fp32 scale stored in their last 4 bytes (through
a float32 view of the cache), fp8 rows are rounded to the fp8 grid in fp32 (round to nearest
even, `_round_fp8`) before the cast, so the bytes do not depend on how a Triton build or its
interpreter rounds the cast itself.

`copy_blocks`: for each (src, dst) pair, block src of every layer slot and of K and V is copied
over block dst: copy-on-write after a fork, in one launch for the whole step. (Swap moves blocks
between device and host memory, which is a transfer, not a kernel: kv_cache.py does it.)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from octavo.model.kernels.triton import check_device, interpreted, jit

RINT_MAGIC = 12582912.0  # 1.5 * 2**23: (y + M) - M rounds |y| < 2**22 to nearest even


@jit
def _rint(y):
    return (y + RINT_MAGIC) - RINT_MAGIC


@jit
def _round_fp8(y, MANT: tl.constexpr, MIN_EXP: tl.constexpr):
    """y (fp32, within the format's range) rounded to the nearest fp8 value, ties to even:
    the quantum of y's binade (subnormals: of the smallest normal one) is a power of two, so
    y / quantum and back are exact."""
    e = ((y.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    e = tl.maximum(e, MIN_EXP)
    quantum = ((e - MANT + 127) << 23).to(tl.float32, bitcast=True)
    return _rint(y / quantum) * quantum


@jit
def _write_kv_quant_kernel(x_ptr, cache_ptr, cache_f32_ptr, slots_ptr, scale_ptr, stride_xt,
                           rows, HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                           WIDTH: tl.constexpr, BLOCK_D: tl.constexpr, ROWS: tl.constexpr,
                           KIND: tl.constexpr, FP8_MAX: tl.constexpr, MANT: tl.constexpr,
                           MIN_EXP: tl.constexpr):
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # (token, KV head) rows
    t = (r // HEADS).to(tl.int64)
    h = r % HEADS
    slot = tl.load(slots_ptr + t, mask=r < rows, other=-1).to(tl.int64)
    ok = (r < rows) & (slot >= 0)
    d = tl.arange(0, BLOCK_D)
    mask = ok[:, None] & (d[None, :] < HEAD_DIM)
    x = tl.load(x_ptr + t[:, None] * stride_xt + h[:, None] * HEAD_DIM + d[None, :], mask=mask,
                other=0.0).to(tl.float32)
    dst = (slot * HEADS + h) * WIDTH
    if KIND == 1:  # int8, the row's scale after its values
        s = tl.maximum(tl.max(tl.abs(x), 1), 1e-12) / 127.0
        q = tl.minimum(tl.maximum(_rint(x / s[:, None]), -127.0), 127.0)
        tl.store(cache_ptr + dst[:, None] + d[None, :], q.to(tl.int8), mask=mask)
        tl.store(cache_f32_ptr + (dst + HEAD_DIM) // 4, s, mask=ok)
    else:  # fp8, a scale per KV head
        s = tl.load(scale_ptr + h, mask=ok, other=1.0)
        y = tl.minimum(tl.maximum(x / s[:, None], -FP8_MAX), FP8_MAX)
        y = _round_fp8(y, MANT, MIN_EXP)
        tl.store(cache_ptr + dst[:, None] + d[None, :],
                 y.to(cache_ptr.dtype.element_ty), mask=mask)


def write_kv_quantized(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                       v_cache: torch.Tensor, slot_mapping: torch.Tensor, kv) -> None:
    """write_kv into int8 / fp8 pages (`kv`: the layer's kv_quant.KVQuant)."""
    check_device(k)
    tokens, heads, dim = k.shape
    if tokens == 0:
        return
    width = k_cache.shape[-1]
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and width % 4 == 0
    fmt = kv.fmt
    kind = 1 if fmt.name == "int8" else 2
    fp8 = {"fp8_e4m3": (448.0, 3, -6), "fp8_e5m2": (57344.0, 2, -14)}.get(fmt.name,
                                                                          (0.0, 0, 0))
    rows = tokens * heads
    per = 256 if interpreted() else 4
    for x, cache, scale in ((k, k_cache, kv.k_scale), (v, v_cache, kv.v_scale)):
        assert x.stride(2) == 1 and x.stride(1) == dim
        f32 = cache.view(torch.uint8).view(torch.float32) if kind == 1 else cache
        _write_kv_quant_kernel[(triton.cdiv(rows, per),)](
            x, cache, f32, slot_mapping, scale if scale is not None else f32, x.stride(0),
            rows, HEADS=heads, HEAD_DIM=dim, WIDTH=width,
            BLOCK_D=triton.next_power_of_2(dim), ROWS=per, KIND=kind, FP8_MAX=fp8[0],
            MANT=fp8[1], MIN_EXP=fp8[2],
        )


@jit
def _write_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slots_ptr, stride_kt, stride_vt,
                     tokens, ROW: tl.constexpr, BLOCK: tl.constexpr, TOKENS: tl.constexpr):
    t = tl.program_id(0) * TOKENS + tl.arange(0, TOKENS)
    slot = tl.load(slots_ptr + t, mask=t < tokens, other=-1).to(tl.int64)[:, None]
    t = t.to(tl.int64)[:, None]
    for i in range(0, ROW, BLOCK):
        offs = (i + tl.arange(0, BLOCK))[None, :]
        mask = (slot >= 0) & (offs < ROW)
        k = tl.load(k_ptr + t * stride_kt + offs, mask=mask)
        v = tl.load(v_ptr + t * stride_vt + offs, mask=mask)
        tl.store(k_cache_ptr + slot * ROW + offs, k, mask=mask)
        tl.store(v_cache_ptr + slot * ROW + offs, v, mask=mask)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k, v: [T, num_kv_heads, head_dim] (each row contiguous, rows may be strided: views of
    the fused qkv buffer); caches [num_blocks, block_size, num_kv_heads, head_dim]."""
    check_device(k)
    tokens, heads, dim = k.shape
    if tokens == 0:
        return
    assert k.stride(2) == 1 and k.stride(1) == dim and v.stride(2) == 1 and v.stride(1) == dim
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    row = heads * dim
    per = 64 if interpreted() else 1  # tokens per program (the interpreter pays per program)
    _write_kv_kernel[(triton.cdiv(tokens, per),)](
        k, v, k_cache, v_cache, slot_mapping, k.stride(0), v.stride(0), tokens,
        ROW=row, BLOCK=min(1024, triton.next_power_of_2(row)), TOKENS=per,
    )


@jit
def _copy_blocks_kernel(cache_ptr, pairs_ptr, stride_part, stride_block,
                        BLOCK_ELEMS: tl.constexpr, BLOCK: tl.constexpr):
    pair = tl.program_id(0)
    part = tl.program_id(1)  # layer slot x (K, V)
    src = tl.load(pairs_ptr + 2 * pair).to(tl.int64)
    dst = tl.load(pairs_ptr + 2 * pair + 1).to(tl.int64)
    base = cache_ptr + part.to(tl.int64) * stride_part
    for i in range(0, BLOCK_ELEMS, BLOCK):
        offs = i + tl.arange(0, BLOCK)
        mask = offs < BLOCK_ELEMS
        x = tl.load(base + src * stride_block + offs, mask=mask)
        tl.store(base + dst * stride_block + offs, x, mask=mask)


def copy_blocks(cache: torch.Tensor, pairs: torch.Tensor) -> None:
    """cache: [slots, 2, blocks, block_size, kv_heads, head_dim] (contiguous); pairs: [n, 2]
    (src, dst) block ids."""
    check_device(cache)
    if pairs.numel() == 0:
        return
    assert cache.is_contiguous()
    parts = cache.shape[0] * cache.shape[1]
    elems = cache[0, 0, 0].numel()
    _copy_blocks_kernel[(pairs.shape[0], parts)](
        cache, pairs.contiguous(), cache.stride(1), cache.stride(2),
        BLOCK_ELEMS=elems, BLOCK=min(2048, triton.next_power_of_2(elems)),
    )
