"""CPU backend: the compiled paged-decode kernel for decodes, torch for prefill chunks.

Decode attention on CPU is bound by reading K/V; the torch backend first gathers every block
into a padded copy and then reads it again (and SDPA expands GQA heads), while the kernel reads
each K/V row once, in place. Sliding-window and soft-capped layers (Gemma) decode through the
torch path.
"""

from __future__ import annotations

import torch

from octavo.model.attention.base import AttentionMetadata
from octavo.model.attention.torch_backend import TorchAttentionBackend


class CpuPagedAttentionBackend(TorchAttentionBackend):
    name = "cpu"

    def __init__(self, kernel) -> None:
        self.kernel = kernel

    def _decode(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float,
                window: int | None = None, softcap: float | None = None) -> torch.Tensor:
        if window is not None or softcap is not None:  # the kernel has neither: torch's path
            return TorchAttentionBackend._decode(q, k_cache, v_cache, meta, scale, window,
                                                 softcap)
        return self.kernel.paged_decode(
            q.contiguous(), k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens,
            scale,
        )
