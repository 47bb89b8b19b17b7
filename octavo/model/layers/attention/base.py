"""The attention backend interface: paged attention behind one small contract.

The runner builds one `AttentionMetadata` per step; every layer's attention calls
`backend.forward(...)`, which first writes the step's new K/V into the paged cache at the slot
mapping, then attends each query to its sequence's past K/V, read only through block tables.
With a quantized KV cache (`kv`), attention reads K/V as the cache stores them, the step's
own tokens included, so a token's result does not depend on how its context was chunked.
Sequences are ordered decodes first (one token each), then prefill chunks.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
from torch.nn.utils.rnn import pad_sequence

from octavo.model.layers.kv_quant import KVQuant


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
    # the prefill chunks as one batch, for kernels that take them in one call (prefill_batch)
    prefill_block_tables: torch.Tensor | None = None
    prefill_query_start: torch.Tensor | None = None
    prefill_start_pos: torch.Tensor | None = None


def decode_step_args(metas: list[AttentionMetadata], rows: int) -> tuple | None:
    """For a step whose `rows` rows are all single-token decodes in every KV cache group: each
    group's slot mapping, decode block tables, context lengths and first positions, as lists
    (the C++ decode loop's arguments, decode_stack.py); else None."""
    for meta in metas:
        if meta.prefills or meta.num_decodes != rows:
            return None
    return ([m.slot_mapping for m in metas], [m.decode_block_tables for m in metas],
            [m.decode_context_lens for m in metas], [m.decode_first_pos for m in metas])


def prefill_batch(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The prefill chunks as one batch, built on first use and kept with the step's metadata
    (every layer reads the same): each chunk's block table padded to one width
    [num_chunks, width], its rows in q counted from the first prefill row (query_start,
    [num_chunks + 1]) and its start position [num_chunks]."""
    if meta.prefill_block_tables is None:
        chunks = meta.prefills
        first = chunks[0].query_start
        meta.prefill_block_tables = pad_sequence([c.block_table for c in chunks],
                                                 batch_first=True)
        device = meta.prefill_block_tables.device
        meta.prefill_query_start = torch.tensor(
            [c.query_start - first for c in chunks] + [chunks[-1].query_end - first],
            device=device)
        meta.prefill_start_pos = torch.tensor([c.start_pos for c in chunks], device=device)
    assert meta.prefill_query_start is not None and meta.prefill_start_pos is not None
    return meta.prefill_block_tables, meta.prefill_query_start, meta.prefill_start_pos


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
        kv: KVQuant | None = None,
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        """`window` (local attention): a query at position p sees only the keys at positions
        (p - window, p]; `softcap`: scores become tanh(s / softcap) * softcap before the softmax.
        Both None: plain causal attention. `kv`: the caches hold quantized rows (kv_quant.py):
        the step's K/V are written quantized and every key, the step's own included, is read
        back as stored, in fp32. None: the caches hold the model dtype."""
