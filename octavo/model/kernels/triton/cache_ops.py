"""The paged cache's own kernels in Triton: the KV write and block copies.

`write_kv` (vLLM's reshape_and_cache): token t's K and V rows, every KV head, go to slot
`slot_mapping[t]` of the layer's cache (slot = block * block_size + offset); a negative slot
skips the token (the padded rows of a CUDA-graph batch). One program per token on a GPU.

`copy_blocks`: for each (src, dst) pair, block src of every layer slot and of K and V is copied
over block dst: copy-on-write after a fork, in one launch for the whole step. (Swap moves blocks
between device and host memory, which is a transfer, not a kernel: kv_cache.py does it.)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from octavo.model.kernels.triton import check_device, interpreted, jit


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
