"""`quantization="gguf"`: a GGUF file's linear weights kept in their blocks and computed
directly (block_quant.py), for the types `GGUFBlocks.get` returns blocks for (Q4_0, Q4_1,
Q8_0, Q4_K, Q5_K, Q6_K: gguf_blocks.py); the loader (model/gguf_loader.py) dequantizes every
other tensor, one at a time, into the model's dtype.

A tensor's blocks are given the rows the HF layout has: llama files store q and k with their
rows permuted for llama.cpp's RoPE, which transformers undoes on the dequantized tensors; here
the same row permutation is applied to the blocks (a row of blocks is a row of weights). q/k/v
and gate/up are joined by rows as the fused layers want (gguf_blocks.fused_linear: parts of
different formats stay in their own blocks, block_concat.py). A tied LM head computes from the
token embeddings' blocks, and the embedding lookup widens only its tokens' rows of those same
blocks (`BlockEmbedding`).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from octavo.model.quant.gguf_blocks import FORMATS, Blocks, _planes
from octavo.model.quant.gguf_file import GGUFFile

logger = logging.getLogger(__name__)


class GGUFBlocks:
    """The block-quantized tensors of one GGUF file, by GGUF name."""

    def __init__(self, gf: GGUFFile) -> None:
        self.file = gf
        self.tensors = gf.tensors

    def get(self, name: str, rows_perm: torch.Tensor | None = None) -> Blocks | None:
        """Tensor `name` in its block format (gguf_blocks.py), rows in the order `rows_perm`,
        or None when it is not kept in blocks (not a matrix, or of a type dequantized at
        load)."""
        t = self.tensors.get(name)
        if t is None or t.type_name not in FORMATS or len(t.shape) != 2:
            return None
        blocks = _planes(t.type_name, self.file.raw(name), t.rows, t.cols)
        if blocks is None:
            logger.warning("GGUF tensor %s: Q4_0 scales too large for float16 mins; it is "
                           "dequantized instead", name)
            return None
        return blocks.rows(rows_perm)


class BlockEmbedding(nn.Module):
    """The token embeddings looked up in their GGUF blocks: each step widens only its own
    tokens' rows. `table` is a block layer (a tied LM head's own, when it is tied)."""

    def __init__(self, table: nn.Module, dtype: torch.dtype) -> None:
        super().__init__()
        self.table = table
        self.dtype = dtype
        self.num_embeddings, self.embedding_dim = table.out_features, table.in_features

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        rows = self.table.dequantize_rows(input_ids.reshape(-1))
        return rows.to(self.dtype).reshape(*input_ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.table.extra_repr()}"


def block_types() -> frozenset[str]:
    """The GGML types whose tensors block layers run as they are."""
    return frozenset(FORMATS)
