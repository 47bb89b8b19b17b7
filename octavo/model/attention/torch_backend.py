"""Paged attention in plain PyTorch: runs on CPU and CUDA alike.

Decodes are batched: their blocks are gathered through the (padded) block tables and one
scaled-dot-product attention call masks each row to its context length. A prefill chunk that
starts at position 0 needs no gather at all (its keys are exactly the new tokens, causal); a
chunk that starts later (prefix-cache hit, chunked prompt) gathers its blocks and uses an
offset causal mask.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from octavo.model.attention.base import AttentionBackend, AttentionMetadata


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v)


def gather_blocks(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """[..., nblocks] block ids -> [..., nblocks * block_size, kv_heads, head_dim]."""
    g = cache[block_tables]
    return g.flatten(-4, -3)


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float):
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        nd = meta.num_decodes
        if nd:
            out[:nd] = self._decode(q[:nd], k_cache, v_cache, meta, scale)
        for chunk in meta.prefills:
            s, e = chunk.query_start, chunk.query_end
            out[s:e] = self._prefill(q[s:e], k[s:e], v[s:e], k_cache, v_cache, chunk, scale)
        return out

    @staticmethod
    def _decode(q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        keys = gather_blocks(k_cache, meta.decode_block_tables)  # [B, L, kvh, d]
        values = gather_blocks(v_cache, meta.decode_block_tables)
        length = keys.shape[1]
        positions = torch.arange(length, device=q.device)
        mask = positions[None, :] < meta.decode_context_lens[:, None]  # [B, L]
        o = F.scaled_dot_product_attention(
            q.unsqueeze(2),  # [B, h, 1, d]
            keys.transpose(1, 2),
            values.transpose(1, 2),
            attn_mask=mask[:, None, None, :],
            scale=scale,
            enable_gqa=True,
        )
        return o.squeeze(2)

    @staticmethod
    def _prefill(q, k, v, k_cache, v_cache, chunk, scale: float) -> torch.Tensor:
        qlen = q.shape[0]
        if chunk.start_pos == 0:
            o = F.scaled_dot_product_attention(
                q.transpose(0, 1)[None],
                k.transpose(0, 1)[None],
                v.transpose(0, 1)[None],
                is_causal=True,
                scale=scale,
                enable_gqa=True,
            )
            return o[0].transpose(0, 1)
        ctx = chunk.start_pos + qlen
        block_size = k_cache.shape[1]
        nblocks = -(-ctx // block_size)
        table = chunk.block_table[:nblocks]
        keys = gather_blocks(k_cache, table)[:ctx]  # [ctx, kvh, d]
        values = gather_blocks(v_cache, table)[:ctx]
        q_pos = torch.arange(chunk.start_pos, ctx, device=q.device)
        k_pos = torch.arange(ctx, device=q.device)
        mask = k_pos[None, :] <= q_pos[:, None]  # [qlen, ctx]
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None],
            keys.transpose(0, 1)[None],
            values.transpose(0, 1)[None],
            attn_mask=mask[None, None],
            scale=scale,
            enable_gqa=True,
        )
        return o[0].transpose(0, 1)
