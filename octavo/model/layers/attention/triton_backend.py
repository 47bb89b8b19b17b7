"""Triton backend: octavo's Triton kernels (model/kernels/triton/) behind the attention
interface, the default on CUDA where Triton is installed.

Per layer and step: one launch writes the step's K/V at the slot mapping, one split-K decode
pass and its reduce cover every decode row, and one varlen launch covers every prefill chunk
(prompts, chunked-prefill continuations, prefix-cache hits), reading earlier K/V in place
through the block tables. Sliding-window and soft-capped layers take the same kernels.

Quantized KV pages (`kv`, kv_quant.py): the write quantizes (cache_ops.write_kv_quantized), the
two attention kernels widen and scale each tile as they load it.

On a machine without a GPU the kernels run in Triton's interpreter on CPU tensors: exact, and
slow; the tests use it to check the kernels against the torch backend.
"""

from __future__ import annotations

import torch

from octavo.model.kernels.triton import triton_missing
from octavo.model.layers.attention.base import AttentionBackend, AttentionMetadata, prefill_batch
from octavo.model.layers.kv_quant import KVQuant


class TritonAttentionBackend(AttentionBackend):
    name = "triton"

    def __init__(self) -> None:
        problem = triton_missing()
        if problem is not None:
            raise RuntimeError(f"attention_backend='triton': {problem}")
        from octavo.model.kernels.triton import cache_ops, decode, prefill

        self._write_kv = cache_ops.write_kv
        self._write_kv_quantized = cache_ops.write_kv_quantized
        self._decode = decode.paged_decode
        self._prefill = prefill.paged_prefill

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float,
                window: int | None = None, softcap: float | None = None,
                kv: KVQuant | None = None):
        if kv is None:
            self._write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        else:
            self._write_kv_quantized(k, v, k_cache, v_cache, meta.slot_mapping, kv)
        out = torch.empty_like(q)
        nd = meta.num_decodes
        if nd:
            self._decode(q[:nd], k_cache, v_cache, meta.decode_block_tables,
                         meta.decode_context_lens, scale, meta.decode_first_pos,
                         window or 0, softcap or 0.0, out=out[:nd], kv=kv)
        if meta.prefills:
            tables, query_start, start_pos = prefill_batch(meta)
            max_len = max(c.query_end - c.query_start for c in meta.prefills)
            self._prefill(q[nd:], k_cache, v_cache, tables, query_start, start_pos,
                          max_len, scale, window or 0, softcap or 0.0,
                          out=out[nd:], kv=kv)
        return out
