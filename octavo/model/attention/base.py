"""The attention backend interface: paged attention behind one small contract.

The runner builds one `AttentionMetadata` per step; every layer's attention calls
`backend.forward(...)`, which first writes the step's new K/V into the paged cache at the slot
mapping, then attends each query to its sequence's past K/V, read only through block tables.
Sequences are ordered decodes first (one token each), then prefill chunks.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass(slots=True)
class PrefillChunk:
    """A run of ``query_end - query_start`` new tokens of one sequence (rows of the flat batch)."""

    query_start: int
    query_end: int
    start_pos: int  # tokens of this sequence already in the cache before this chunk
    block_table: torch.Tensor  # [num_blocks_of_seq] physical block ids (long, on device)


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] long: where each new token's K/V is written
    num_decodes: int  # the first num_decodes rows are single-token decodes
    decode_block_tables: torch.Tensor | None  # [num_decodes, max_blocks] long, padded
    decode_context_lens: torch.Tensor | None  # [num_decodes] long
    prefills: list[PrefillChunk]
    # sliding-window groups: the position of each decode row's first gathered key (its block
    # table starts at the window's first block); None: the tables start at position 0
    decode_first_pos: torch.Tensor | None = None


class AttentionBackend(ABC):
    name: str

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [T, num_heads, head_dim]
        k: torch.Tensor,  # [T, num_kv_heads, head_dim]
        v: torch.Tensor,
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        """`window` (local attention): a query at position p sees only the keys at positions
        (p - window, p]; `softcap`: scores become tanh(s / softcap) * softcap before the softmax.
        Both None: plain causal attention."""
