"""`quantization="gguf"`: a GGUF file's linear weights kept in their blocks and computed
directly (block_quant.py), for the types `GGUFBlocks.get` returns blocks for (Q4_0, Q4_1,
Q8_0); the loader (model/gguf_loader.py) dequantizes every other tensor, one at a time, into
the model's dtype.

A GGUF tensor's blocks are split into planes (quants, float16 scales, float16 mins) and given
the rows the HF layout has: llama files store q and k with their rows permuted for llama.cpp's
RoPE, which transformers undoes on the dequantized tensors; here the same row permutation is
applied to the blocks (a row of blocks is a row of weights). q/k/v and gate/up are
concatenated by rows as the fused layers want (`concat_blocks`; parts of different formats
leave the layer dense). A tied LM head computes from the token embeddings' blocks, and where
the block layer can widen single rows (`dequantize_rows`) the embedding lookup reads them too
(`BlockEmbedding`).
"""

from __future__ import annotations

import logging

import numpy as np
import torch
from torch import nn

from octavo.model.quant.block_quant import INT4, INT8, BlockFormat, BlockQuantLinear
from octavo.model.quant.gguf_file import GGUFFile

logger = logging.getLogger(__name__)

# GGML type name -> (format, bytes per block of 32)
FORMATS = {
    "Q4_0": (BlockFormat("q4_0", INT4, 32, int8_activations=True), 18),
    "Q4_1": (BlockFormat("q4_1", INT4, 32, int8_activations=True), 20),
    "Q8_0": (BlockFormat("q8_0", INT8, 32, int8_activations=True), 34),
}


def _planes(type_name: str, raw: np.ndarray, rows: int, cols: int):
    """A GGUF tensor's raw blocks [rows, bytes] -> (q, scale, mins) torch tensors."""
    fmt, size = FORMATS[type_name]
    blocks = np.ascontiguousarray(raw).reshape(rows, cols // 32, size)
    scale = blocks[..., 0:2].copy().view(np.float16).reshape(rows, cols // 32)
    if type_name == "Q4_0":  # w = (q - 8) d = q d + (-8 d); -8 d is exact in float16
        q = blocks[..., 2:18].reshape(rows, cols // 2)
        if np.abs(scale.astype(np.float32)).max(initial=0) * 8 > np.finfo(np.float16).max:
            return None  # -8 d overflows float16 (weights past 65504): dequantized instead
        mins = (scale.astype(np.float32) * -8).astype(np.float16)
    elif type_name == "Q4_1":
        mins = blocks[..., 2:4].copy().view(np.float16).reshape(rows, cols // 32)
        q = blocks[..., 4:20].reshape(rows, cols // 2)
    else:
        q = blocks[..., 2:34].copy().view(np.int8).reshape(rows, cols)
        mins = None
    to = torch.from_numpy
    return fmt, to(np.ascontiguousarray(q)), to(np.ascontiguousarray(scale)), (
        None if mins is None else to(np.ascontiguousarray(mins)))


class GGUFBlocks:
    """The block-quantized tensors of one GGUF file, by GGUF name."""

    def __init__(self, gf: GGUFFile) -> None:
        self.file = gf
        self.tensors = gf.tensors

    def get(self, name: str, rows_perm: torch.Tensor | None = None):
        """(format, q, scale, mins) of tensor `name`, or None when it is not kept in blocks
        (not a matrix, or of a type dequantized at load)."""
        t = self.tensors.get(name)
        if t is None or t.type_name not in FORMATS or len(t.shape) != 2:
            return None
        planes = _planes(t.type_name, self.file.raw(name), t.rows, t.cols)
        if planes is None:
            logger.warning("GGUF tensor %s: Q4_0 scales too large for float16 mins; it is "
                           "dequantized instead", name)
            return None
        fmt, q, scale, mins = planes
        if rows_perm is not None:
            q, scale = q[rows_perm].contiguous(), scale[rows_perm].contiguous()
            mins = None if mins is None else mins[rows_perm].contiguous()
        return fmt, q, scale, mins


def concat_blocks(parts):
    """Concatenate (format, q, scale, mins) by rows; None unless all share one format."""
    if not parts or any(p is None for p in parts) or len({p[0] for p in parts}) != 1:
        return None
    fmt = parts[0][0]
    mins = None if parts[0][3] is None else torch.cat([p[3] for p in parts])
    return fmt, torch.cat([p[1] for p in parts]), torch.cat([p[2] for p in parts]), mins


def block_linear(parts) -> BlockQuantLinear:
    """The block layer of concatenated parts (its bias is set by the loader)."""
    fmt, q, scale, mins = parts
    return BlockQuantLinear(fmt, q, scale, mins, None)


def rows_lookup_supported() -> bool:
    """Whether block layers can widen single rows (an embedding lookup in blocks)."""
    return callable(getattr(BlockQuantLinear, "dequantize_rows", None))


class BlockEmbedding(nn.Module):
    """The token embeddings looked up in their GGUF blocks: each step widens only its own
    tokens' rows. `table` is a block layer (a tied LM head's own, when it is tied)."""

    def __init__(self, table: BlockQuantLinear, dtype: torch.dtype) -> None:
        super().__init__()
        self.table = table
        self.dtype = dtype
        self.num_embeddings, self.embedding_dim = table.out_features, table.in_features

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        rows = self.table.dequantize_rows(input_ids.reshape(-1))  # type: ignore[operator]
        return rows.to(self.dtype).reshape(*input_ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.table.fmt.name} blocks"


def block_types() -> frozenset[str]:
    """The GGML types whose tensors block layers run as they are."""
    return frozenset(FORMATS)
