"""GGUF tensor types -> the block formats octavo computes in: which GGML types a linear layer
keeps in its blocks, and how a tensor's raw bytes become the tensors `BlockQuantLinear` holds.

- Q4_0, Q4_1, Q8_0 (blocks of 32): split into planes, quants, float16 scales and mins
  (block_quant.py's 4-bit and 8-bit kinds; Q4_0's w = (q - 8) d becomes q d + (-8 d)).
- Q5_0 (blocks of 32; llama.cpp's Q4_K_M falls back to it where a row is not whole 256-weight
  super-blocks, as Gemma 3 270M's 640 columns): the float16 scale in the scale plane, the
  file's 16 bytes of low nibbles and 4 bytes of fifth bits (in that order) a block of q,
  block_quant.py's 5-bit kind: 22 bytes a block of 32, as in the file.
- Q4_K, Q5_K, Q6_K (super-blocks of 256): one uint8 row of super-blocks per weight row, the
  file's bytes with Q4_K's and Q5_K's 6-bit scales and mins unpacked to a byte each
  (kquant.repack: 148 and 180 bytes a super-block instead of 144 and 176; Q6_K unchanged).
Every other type (IQ*, Q2_K, Q3_K, Q8_K, F16, BF16, ...) has no format here: its tensor is
dequantized to fp32 by the loader.

The result, `Blocks`, has its rows in the tensor's row order; `rows(perm)` reorders them (GGUF's
q/k row permutation, undone), `cat_rows` joins layers fused by rows (q/k/v, gate/up) and
`fused_linear` builds the layer, parts of different formats included (block_concat.py).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch
from torch import nn

from octavo.model.quant import kquant
from octavo.model.quant.block_concat import BlockConcat
from octavo.model.quant.block_quant import INT4, INT5, INT8, BlockFormat, BlockQuantLinear

Q8_0 = BlockFormat("q8_0", INT8, 32, int8_activations=True)
# GGML type name -> (format, bytes in the file per block of fmt.group weights)
FORMATS = {
    "Q4_0": (BlockFormat("q4_0", INT4, 32, int8_activations=True), 18),
    "Q4_1": (BlockFormat("q4_1", INT4, 32, int8_activations=True), 20),
    "Q5_0": (BlockFormat("q5_0", INT5, 32, int8_activations=True), 22),
    "Q8_0": (Q8_0, 34),
    "Q4_K": (BlockFormat("q4_k", kquant.Q4_K, 256, int8_activations=True),
             kquant.FILE_BYTES[kquant.Q4_K]),
    "Q5_K": (BlockFormat("q5_k", kquant.Q5_K, 256, int8_activations=True),
             kquant.FILE_BYTES[kquant.Q5_K]),
    "Q6_K": (BlockFormat("q6_k", kquant.Q6_K, 256, int8_activations=True),
             kquant.FILE_BYTES[kquant.Q6_K]),
}


class Blocks(NamedTuple):
    """One weight in a block format: what `BlockQuantLinear` is built from."""

    fmt: BlockFormat
    q: torch.Tensor
    scale: torch.Tensor | None
    mins: torch.Tensor | None

    def rows(self, perm: torch.Tensor | None) -> Blocks:
        """The same weight with its rows in the order `perm` (None: unchanged)."""
        if perm is None:
            return self
        pick = (lambda t: None if t is None else t[perm].contiguous())
        return Blocks(self.fmt, pick(self.q), pick(self.scale), pick(self.mins))

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.q, self.scale, self.mins)
                   if t is not None)

    def linear(self, bias: torch.Tensor | None = None) -> BlockQuantLinear:
        return BlockQuantLinear(self.fmt, self.q, self.scale, self.mins, bias)


def cat_rows(parts: list[Blocks | None]) -> Blocks | None:
    """Weights concatenated by rows; None unless all are blocks of one format."""
    if not parts or any(p is None for p in parts) or len({p.fmt for p in parts}) != 1:
        return None
    first = parts[0]
    join = (lambda ts: None if ts[0] is None else torch.cat(ts))
    return Blocks(first.fmt, join([p.q for p in parts]), join([p.scale for p in parts]),
                  join([p.mins for p in parts]))


def fused_linear(parts: list[Blocks | None],
                 bias: torch.Tensor | None = None) -> BlockQuantLinear | BlockConcat | None:
    """The layer of weights fused by rows (q/k/v, gate/up; `bias` the fused one): one
    `BlockQuantLinear` where the parts share a format, a `BlockConcat` of one per part where
    they do not (a Q4_K_M file's Q6_K v beside Q4_K q and k); None where a part has no block
    format (the layer keeps its fp32 weight)."""
    joined = cat_rows(parts)
    if joined is not None:
        return joined.linear(bias)
    if not parts or any(p is None for p in parts):
        return None
    layers, start = [], 0
    for p in parts:
        assert p is not None
        n = p.q.shape[0]
        layers.append(p.linear(None if bias is None else bias[start:start + n]))
        start += n
    return BlockConcat(layers)


def block_linears(layer: nn.Module) -> list[BlockQuantLinear]:
    """The `BlockQuantLinear`s a layer built by `fused_linear` computes with."""
    return list(layer.parts) if isinstance(layer, BlockConcat) else [layer]


def block_type(type_name: str) -> bool:
    """Whether a linear weight of this GGML type is computed in its blocks."""
    return type_name in FORMATS


def _planes(type_name: str, raw: np.ndarray, rows: int, cols: int) -> Blocks | None:
    """A GGUF tensor's raw blocks [rows, bytes] -> `Blocks`, or None where the type cannot be
    kept (a Q4_0 whose -8 d overflows float16)."""
    fmt, size = FORMATS[type_name]
    if cols % fmt.group:
        raise ValueError(f"a {type_name} tensor of {cols} columns is not whole blocks of "
                         f"{fmt.group}")
    to = torch.from_numpy
    if fmt.kquant:
        q = np.ascontiguousarray(raw).reshape(rows, cols // fmt.group * size)
        return Blocks(fmt, kquant.repack(fmt.kind, to(q.copy())), None, None)
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
    elif type_name == "Q5_0":  # [d, 4 bytes of fifth bits, 16 of low nibbles] -> nibbles, bits
        q = np.concatenate([blocks[..., 6:22], blocks[..., 2:6]], axis=-1).reshape(rows, -1)
        mins = None
    else:
        q = blocks[..., 2:34].copy().view(np.int8).reshape(rows, cols)
        mins = None
    return Blocks(fmt, to(np.ascontiguousarray(q)), to(np.ascontiguousarray(scale)),
                  None if mins is None else to(np.ascontiguousarray(mins)))
