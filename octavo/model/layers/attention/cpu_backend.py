"""CPU backend: octavo's compiled paged-attention kernels (csrc/), one call per layer for the
decodes and one for every prefill chunk of the step.

Decode attention on CPU is bound by reading K/V; the torch backend first gathers every block
into a padded copy and then reads it again (and SDPA expands GQA heads), while the decode kernel
reads each K/V row once, in place. The prefill kernel takes every prefill chunk of the step at
once (prompts, chunked-prefill continuations, prefix-cache hits, speculative verification
chunks), reading their earlier K/V in place through the block tables: no gather, no mask tensor
and no per-sequence call. Sliding-window layers and soft-capped layers (Gemma 2) take both
kernels too. A head_dim the prefill kernel does not take (not a multiple of 8) falls back to
the torch backend's per-chunk path, and so does the portable build (cpu_isa.py), whose prefill
kernel is exact but slower than torch's SDPA, which picks its own ISA at run time: measured
with `octavo bench cpu` on 8 prompts of 32-512 tokens, 0.3x torch's speed (AVX2 build 1.5x,
AVX-512 build 1.8x; on 64 verification chunks of 5 tokens 1.2x, 2.8x and 3.9x). On a CPU with
AVX-512 bf16 dot products (avx512_bf16), bf16 prefill takes them (prefill_bf16_dot.h) instead
of widening K/V to fp32: 1.5-1.7x faster on the same steps.

Quantized KV pages (`kv`, kv_quant.py): the compiled `kv_write` stores the step's K/V
quantized, byte for byte as kv_quant.quantize does, and both kernels read the int8 / fp8 rows
in place (kv_rows.h).
"""

from __future__ import annotations

import torch

from octavo.model.layers.attention.base import AttentionMetadata, prefill_batch
from octavo.model.layers.attention.torch_backend import TorchAttentionBackend, write_kv
from octavo.model.layers.kv_quant import KVQuant


class CpuPagedAttentionBackend(TorchAttentionBackend):
    name = "cpu"

    def __init__(self, kernel, bf16_dot: bool = True) -> None:
        self.kernel = kernel
        self.prefill_kernel = kernel.isa() != "portable"
        # bf16 prefill on the CPU's bf16 dot products where it has them (False: widened to
        # fp32, as on CPUs without them; `octavo bench cpu` times both)
        self.bf16_dot = bf16_dot

    @property
    def isa(self) -> str:
        return self.kernel.isa()

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float,
                window: int | None = None, softcap: float | None = None,
                kv: KVQuant | None = None):
        if meta.prefills and (q.shape[-1] % 8 or not self.prefill_kernel):
            return super().forward(q, k, v, k_cache, v_cache, meta, scale, window, softcap, kv)
        if kv is None:
            write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        else:
            self.kernel.kv_write(k, v, k_cache, v_cache, meta.slot_mapping, kv.k_scale,
                                 kv.v_scale)
        nd = meta.num_decodes
        decoded = self._decode(q[:nd], k_cache, v_cache, meta, scale, window, softcap, kv) \
            if nd else None
        if not meta.prefills:
            assert decoded is not None
            return decoded
        tables, query_start, start_pos = prefill_batch(meta)
        prefilled = self.kernel.paged_prefill(
            q[nd:], k_cache, v_cache, tables, query_start, start_pos, scale, window or 0,
            softcap or 0.0, self.bf16_dot, *_scales(kv))
        return prefilled if decoded is None else torch.cat([decoded, prefilled])

    def _decode(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float,
                window: int | None = None, softcap: float | None = None,
                kv: KVQuant | None = None):
        return self.kernel.paged_decode(
            q.contiguous(), k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens,
            scale, meta.decode_first_pos, window or 0, softcap or 0.0, *_scales(kv),
        )


def _scales(kv: KVQuant | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    return (None, None) if kv is None else (kv.k_scale, kv.v_scale)
