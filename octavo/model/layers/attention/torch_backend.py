"""Paged attention in plain PyTorch: runs on CPU and CUDA alike.

Decodes are batched: their blocks are gathered through the (padded) block tables and one
scaled-dot-product attention call masks each row to its context length. A prefill chunk that
starts at position 0 needs no gather at all (its keys are exactly the new tokens, causal); a
chunk that starts later (prefix-cache hit, chunked prompt) gathers its blocks and uses an
offset causal mask.

On CPU in bf16/fp16, a prefill from position 0 of at most EAGER_PREFILL_MAX_LEN tokens runs as two
batched matmuls around an fp32 softmax (transformers' "eager" attention) instead of SDPA: on
CPU, torch's flash kernel does not profit from the narrower dtype, while the matmuls go to
oneDNN's bf16 kernels. Measured inside the `mixed` benchmark (prompts of 32-512 tokens, bf16, one
thread), prefill attention took 1.5 s this way against 2.3 s in SDPA; an isolated loop over one
prompt length favours SDPA from about 300 tokens, so the limit stays at the lengths measured.

Quantized KV pages (`kv`, kv_quant.py) take the masked path in fp32: the step's K/V are
written quantized, the gathered blocks are dequantized, and the step's own keys are used as
stored (dequantize(quantize(k))), never as computed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from octavo.model.layers.attention.base import AttentionBackend, AttentionMetadata
from octavo.model.layers.kv_quant import KVQuant, dequantize, gather_rows, write_quantized

EAGER_PREFILL_MAX_LEN = 512


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


def read_blocks(cache: torch.Tensor, block_tables: torch.Tensor, kv: KVQuant | None,
                which: str) -> torch.Tensor:
    """gather_blocks, dequantized to fp32 where the cache holds quantized rows."""
    if kv is None:
        return gather_blocks(cache, block_tables)
    g = gather_rows(cache, block_tables).flatten(-4, -3)
    return dequantize(g, kv.fmt, kv.k_scale if which == "k" else kv.v_scale)


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float,
                window: int | None = None, softcap: float | None = None,
                kv: KVQuant | None = None):
        if kv is not None:
            k, v = write_quantized(k, v, k_cache, v_cache, meta.slot_mapping, kv)
            out = self._attend_masked(q.float(), k, v, k_cache, v_cache, meta, scale, window,
                                      softcap, kv)
            return out.to(q.dtype)
        if window is not None or softcap is not None:
            return self._forward_masked(q, k, v, k_cache, v_cache, meta, scale, window, softcap)
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        nd = meta.num_decodes
        if nd:
            out[:nd] = self._decode(q[:nd], k_cache, v_cache, meta, scale)
        for chunk in meta.prefills:
            s, e = chunk.query_start, chunk.query_end
            out[s:e] = self._prefill(q[s:e], k[s:e], v[s:e], k_cache, v_cache, chunk, scale)
        return out

    def _forward_masked(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float,
                        window: int | None, softcap: float | None) -> torch.Tensor:
        """Sliding-window and/or soft-capped attention (Gemma): an explicit mask per query,
        scores through the soft cap; the plain path above is left as it is."""
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        return self._attend_masked(q, k, v, k_cache, v_cache, meta, scale, window, softcap)

    def _attend_masked(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float,
                       window: int | None, softcap: float | None,
                       kv: KVQuant | None = None) -> torch.Tensor:
        """The masked path once the step's K/V are in the cache; `kv`: quantized pages, k and
        v the step's rows as stored (fp32)."""
        out = torch.empty_like(q)
        nd = meta.num_decodes
        if nd:
            out[:nd] = self._decode(q[:nd], k_cache, v_cache, meta, scale, window, softcap, kv)
        block_size = k_cache.shape[1]
        for chunk in meta.prefills:
            s, e = chunk.query_start, chunk.query_end
            qlen = e - s
            ctx = chunk.start_pos + qlen
            q_pos = torch.arange(chunk.start_pos, ctx, device=q.device)
            if chunk.start_pos == 0:
                keys, values, first = k[s:e], v[s:e], 0
            else:
                # only the blocks that hold a key some query of the chunk still sees
                lo = 0 if window is None else max(0, chunk.start_pos - window + 1)
                first_block, nblocks = lo // block_size, -(-ctx // block_size)
                table = chunk.block_table[first_block:nblocks]
                first = first_block * block_size
                keys = read_blocks(k_cache, table, kv, "k")[: ctx - first]
                values = read_blocks(v_cache, table, kv, "v")[: ctx - first]
            k_pos = torch.arange(first, ctx, device=q.device)
            mask = k_pos[None, :] <= q_pos[:, None]  # [qlen, keys]
            if window is not None:
                mask &= k_pos[None, :] > q_pos[:, None] - window
            out[s:e] = masked_attention(q[s:e][None], keys[None], values[None], mask[None],
                                        scale, softcap)[0]
        return out

    @staticmethod
    def _decode(q, k_cache, v_cache, meta: AttentionMetadata, scale: float,
                window: int | None = None, softcap: float | None = None,
                kv: KVQuant | None = None) -> torch.Tensor:
        keys = read_blocks(k_cache, meta.decode_block_tables, kv, "k")  # [B, L, kvh, d]
        values = read_blocks(v_cache, meta.decode_block_tables, kv, "v")
        length = keys.shape[1]
        positions = torch.arange(length, device=q.device)[None, :]
        if meta.decode_first_pos is not None:
            positions = positions + meta.decode_first_pos[:, None]
        mask = positions < meta.decode_context_lens[:, None]  # [B, L]
        if window is not None or softcap is not None or kv is not None:
            if window is not None:  # the query sits at context_len - 1
                mask &= positions >= meta.decode_context_lens[:, None] - window
            return masked_attention(q[:, None], keys, values, mask[:, None], scale, softcap)[:, 0]
        o = F.scaled_dot_product_attention(
            q.unsqueeze(2),  # [B, h, 1, d]
            keys.transpose(1, 2),
            values.transpose(1, 2),
            attn_mask=mask[:, None, None, :],  # [B, 1, 1, L]
            scale=scale,
            enable_gqa=True,
        )
        return o.squeeze(2)

    @staticmethod
    def _prefill(q, k, v, k_cache, v_cache, chunk, scale: float) -> torch.Tensor:
        qlen = q.shape[0]
        if (chunk.start_pos == 0 and q.device.type == "cpu" and q.dtype != torch.float32
                and qlen <= EAGER_PREFILL_MAX_LEN):
            return eager_causal(q, k, v, scale)
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


def eager_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal self-attention of one prompt, [L, heads, d] -> [L, heads, d]: one matmul per KV
    head for the scores of its whole query group, softmax in fp32."""
    length, heads, dim = q.shape
    kv_heads = k.shape[1]
    group = heads // kv_heads
    qg = q.view(length, kv_heads, group, dim).permute(1, 2, 0, 3).reshape(kv_heads, -1, dim)
    scores = torch.bmm(qg, k.permute(1, 2, 0)).float().mul_(scale)  # [kvh, group * L, L]
    scores = scores.view(kv_heads, group, length, length)
    causal = torch.ones(length, length, dtype=torch.bool, device=q.device).triu_(1)
    scores.masked_fill_(causal, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(q.dtype).view(kv_heads, -1, length)
    o = torch.bmm(probs, v.transpose(0, 1))  # [kvh, group * L, d]
    return o.view(kv_heads, group, length, dim).permute(2, 0, 1, 3).reshape(length, heads, dim)


def masked_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                     mask: torch.Tensor, scale: float, softcap: float | None) -> torch.Tensor:
    """q [B, Lq, heads, d], keys/values [B, Lk, kv_heads, d], mask [B, Lq, Lk] (True: seen)
    -> [B, Lq, heads, d]. Without a soft cap, SDPA with the mask; with one, transformers'
    eager order: scores * scale, tanh(s / cap) * cap, mask, softmax in fp32."""
    if softcap is None:
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
            attn_mask=mask[:, None], scale=scale, enable_gqa=True,
        )
        return o.transpose(1, 2)
    group = q.shape[2] // keys.shape[2]
    kh = keys.transpose(1, 2).repeat_interleave(group, dim=1)  # [B, heads, Lk, d]
    vh = values.transpose(1, 2).repeat_interleave(group, dim=1)
    scores = torch.matmul(q.transpose(1, 2), kh.transpose(2, 3)) * scale  # [B, heads, Lq, Lk]
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask[:, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, vh).transpose(1, 2)
