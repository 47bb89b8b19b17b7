"""CPU backend: the compiled paged-decode kernel for decodes, torch for prefill chunks.

Decode attention on CPU is bound by reading K/V; the torch backend first gathers every block
into a padded copy and then reads it again (and SDPA expands GQA heads), while the kernel reads
each K/V row once, in place. Sliding-window layers (their tables start at the window's first
block, `decode_first_pos`) and soft-capped layers (Gemma 2) decode through the kernel too.
"""

from __future__ import annotations

from octavo.model.attention.base import AttentionMetadata
from octavo.model.attention.torch_backend import TorchAttentionBackend


class CpuPagedAttentionBackend(TorchAttentionBackend):
    name = "cpu"

    def __init__(self, kernel) -> None:
        self.kernel = kernel

    @property
    def isa(self) -> str:
        return self.kernel.isa()

    def _decode(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float,
                window: int | None = None, softcap: float | None = None):
        return self.kernel.paged_decode(
            q.contiguous(), k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens,
            scale, meta.decode_first_pos, window or 0, softcap or 0.0,
        )
