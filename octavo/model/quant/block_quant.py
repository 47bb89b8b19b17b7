"""Linear layers whose weights stay in 4-, 5- or 8-bit blocks: `quantization="int4"` (quantized
at load from an fp32/bf16 model) and `quantization="gguf"` (a GGUF file's Q4_0, Q4_1, Q5_0 and
Q8_0 tensors, kept as the file has them: gguf_weights.py).

The formats are GGUF's, with the parts of each block stored as planes (the same bits, rows
stay rows):
- 4-bit (`kind` 0): q uint8 [N, K/2], block b of a row in bytes 16b..16b+15, element j of the
  block in the low nibble of byte j and element j+16 in the high one; per group of `group`
  weights a float16 scale and min, w = q * scale + min. GGUF's Q4_1 is this with group 32
  (d, m); Q4_0 is w = (q - 8) * d, so min = -8d (exact in float16); `int4` takes each group's
  (max - min) / 15 and min (group 32 or 128).
- 8-bit (`kind` 1): q int8 [N, K], float16 scale per 32 weights, w = q * scale (GGUF's Q8_0).
- 5-bit (`kind` 5, GGUF's Q5_0): q uint8 [N, K/32 * 20], each block of 32 its 16 bytes of low
  nibbles (as the 4-bit kind packs them) then the 4 bytes of fifth bits (bit j: element j's),
  float16 scale per 32 weights, w = (x - 16) * scale with x in 0..31. The kernel unpacks a block
  to the signed bytes x - 16 and computes them as the 8-bit kind's.

The compiled kernel (csrc/block_linear.cpp) widens each block to fp32 in registers and
multiplies it with the fp32 activations (fp32 accumulation): decode never holds a dequantized
weight. Batches larger than `SMALL_BATCH` rows (prefill) widen a few hundred weight rows at a
time into one reused fp32 buffer and multiply them through the GEMM library, where the
arithmetic, not the weight bytes, is what costs; for the GGUF formats its activations are
quantized as the kernel's are, so a token's logits do not depend on the size of its batch
beyond the order of fp32 sums. Where the compiled ops have them (`_int8_tiles`: the AVX-512
build on a CPU with VNNI, the AVX2 build), the GGUF formats' large batches take integer tiles
in block_linear instead (csrc/block_tile.h, block_tile_avx2.h: the same int8 activations and
exact integer sums per block, 2.7-2.8x the widened tiles' rate on the Zen 4 EPYC).

GGUF's K-quants (Q4_K, Q5_K, Q6_K; kquant.py) are held as the file's super-blocks of 256, one
uint8 tensor per layer, and computed by csrc/kquant_linear.cpp on integer dot products against
activations quantized per 256, at every batch size: at prefill sizes that kernel measured at or
above the widened tiles + oneDNN fp32 GEMM (`octavo bench kquant`; BENCHMARKS.md), and with it a
row's result does not depend on the batch it is computed in at all. `_tiled` still widens them
(the benchmark's comparison).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from octavo.model.quant import kquant

logger = logging.getLogger(__name__)

INT4, INT8, INT5 = 0, 1, 5  # kernel kinds (2-4 are the K-quants': kquant.py)
Q5_BLOCK_BYTES = 20  # a 5-bit block of 32 weights in q
BLOCK = 32
SMALL_BATCH = 16  # rows up to which the register kernel runs (above: widened tiles + GEMM)
TILE_ELEMENTS = 1 << 22  # fp32 elements of the widened tile the large-batch path reuses


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """[N, K] values in 0..15 -> [N, K/2] uint8 in GGUF's order (element j of each block of
    32 in the low nibble of byte j, element j + 16 in the high nibble)."""
    n, k = q.shape
    blocks = q.to(torch.uint8).reshape(n, k // BLOCK, BLOCK)
    return (blocks[..., :16] | (blocks[..., 16:] << 4)).reshape(n, k // 2).contiguous()


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of pack_nibbles: [N, K/2] uint8 -> [N, K] uint8 in 0..15."""
    n, half = packed.shape
    blocks = packed.reshape(n, half // 16, 16)
    return torch.cat((blocks & 15, blocks >> 4), dim=-1).reshape(n, 2 * half)


def quantize_int4(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric 4-bit per group: (q packed [N, K/2], scale, min float16 [N, K/group]);
    q is rounded against the float16 scale and min the kernel will read."""
    n, k = w.shape
    g = w.float().reshape(n, k // group, group)
    lo, hi = g.amin(dim=-1), g.amax(dim=-1)
    scale = ((hi - lo) / 15).half()
    mins = lo.half()
    s = scale.float().clamp_min(torch.finfo(torch.float16).tiny)
    q = torch.round((g - mins.float()[..., None]) / s[..., None]).clamp_(0, 15)
    return pack_nibbles(q.reshape(n, k)), scale.contiguous(), mins.contiguous()


def quantize_int8_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric 8-bit per block of 32 (Q8_0): (q int8 [N, K], scale float16 [N, K/32])."""
    n, k = w.shape
    g = w.float().reshape(n, k // BLOCK, BLOCK)
    scale = (g.abs().amax(dim=-1) / 127).half()
    s = scale.float().clamp_min(torch.finfo(torch.float16).tiny)
    q = torch.round(g / s[..., None]).clamp_(-127, 127).to(torch.int8)
    return q.reshape(n, k), scale.contiguous()


def unpack_fives(q: torch.Tensor) -> torch.Tensor:
    """5-bit blocks [N, K/32 * 20] uint8 -> their values x - 16 [N, K] int8 (in -16..15)."""
    n = q.shape[0]
    blocks = q.reshape(n, -1, Q5_BLOCK_BYTES)
    low = unpack_nibbles(blocks[..., :16].reshape(n, -1)).reshape(n, -1, 32).to(torch.int16)
    high = blocks[..., 16:].to(torch.int32)
    bits = (high[..., 0] | high[..., 1] << 8 | high[..., 2] << 16 | high[..., 3] << 24)
    fifth = (bits[..., None] >> torch.arange(32, dtype=torch.int32)) & 1
    return (low + 16 * fifth - 16).to(torch.int8).reshape(n, -1)


def pack_fives(x: torch.Tensor) -> torch.Tensor:
    """The inverse of unpack_fives: [N, K] values in -16..15 -> [N, K/32 * 20] uint8."""
    n, k = x.shape
    u = (x.to(torch.int16) + 16).reshape(n, k // BLOCK, BLOCK)
    low = pack_nibbles((u & 15).reshape(n, k)).reshape(n, k // BLOCK, 16)
    bits = ((u >> 4).to(torch.int64) << torch.arange(32)).sum(-1)
    high = torch.stack([(bits >> (8 * i)) & 255 for i in range(4)], dim=-1).to(torch.uint8)
    return torch.cat([low, high], dim=-1).reshape(n, -1).contiguous()


def dequantize(kind: int, q: torch.Tensor, scale: torch.Tensor, mins: torch.Tensor | None,
               group: int) -> torch.Tensor:
    """The fp32 weight [N, K] the kernel computes with (the tests' reference)."""
    if kind == INT5:
        q = unpack_fives(q)
    if kind == INT4:
        values = unpack_nibbles(q).float()
        assert mins is not None
        n, k = values.shape
        out = values.reshape(n, k // group, group) * scale.float()[..., None]
        return (out + mins.float()[..., None]).reshape(n, k)
    n, k = q.shape
    return (q.float().reshape(n, k // group, group) * scale.float()[..., None]).reshape(n, k)


def quantize_activations(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] as the int8-activation kernel sees it: per block of 32, xq = round(x / dx)
    with dx = max |x| / 127, returned as xq * dx in fp32."""
    m, k = x.shape
    blocks = x.float().reshape(m, k // BLOCK, BLOCK)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    dx = amax / 127
    # the kernel's rounding: x * (127 / amax), the quotient a true division (torch's scalar
    # 127 / t is a reciprocal times 127, which differs in the last bit)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    return (torch.round(blocks * inv) * dx).reshape(m, k)


@dataclass(frozen=True, slots=True)
class BlockFormat:
    name: str  # q4_0, q4_1, q5_0, q8_0, int4, q4_k, q5_k, q6_k
    kind: int  # INT4, INT8, INT5 or a K-quant's (kquant.Q4_K, Q5_K, Q6_K)
    group: int  # weights per block (K-quants: the super-block of 256)
    # decode quantizes the activations per block of 32 to int8 and takes integer dot
    # products (GGUF's formats, as llama.cpp computes them); False: fp32 activations
    int8_activations: bool = False

    @property
    def bits(self) -> int:
        return {INT4: 4, INT8: 8, INT5: 5, kquant.Q4_K: 4, kquant.Q5_K: 5,
                kquant.Q6_K: 6}[self.kind]

    @property
    def kquant(self) -> bool:
        return kquant.is_kquant(self.kind)


class BlockQuantLinear(nn.Module):
    """y = x W^T + b with W held in 4-, 5- or 8-bit blocks (see the module docstring)."""

    def __init__(self, fmt: BlockFormat, q: torch.Tensor, scale: torch.Tensor,
                 mins: torch.Tensor | None, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.fmt = fmt
        self.out_features = q.shape[0]
        if fmt.kquant:  # the super-blocks hold their own scales
            if scale is not None or mins is not None:
                raise ValueError(f"{fmt.name}: the super-blocks hold their scales; scale and "
                                 "mins must be None")
            self.in_features = kquant.in_features(fmt.kind, q)
            if q.dtype != torch.uint8:
                raise ValueError(f"{fmt.name}: q must be uint8 super-blocks, not {q.dtype}")
            self.register_buffer("q", q.contiguous())
            self.register_buffer("scale", None)
            self.register_buffer("mins", None)
            self.bias = None if bias is None else nn.Parameter(bias.detach().float(),
                                                               requires_grad=False)
            self.ops = None
            return
        if fmt.kind == INT5 and (q.shape[1] % Q5_BLOCK_BYTES or fmt.group != BLOCK):
            raise ValueError(f"{fmt.name}: q must be whole {Q5_BLOCK_BYTES}-byte blocks of "
                             f"{BLOCK} weights, one scale each")
        self.in_features = (q.shape[1] * 2 if fmt.kind == INT4 else
                            q.shape[1] // Q5_BLOCK_BYTES * BLOCK if fmt.kind == INT5 else
                            q.shape[1])
        if self.in_features % fmt.group:
            raise ValueError(f"{fmt.name}: {self.in_features} input features are not a "
                             f"multiple of the group size {fmt.group}")
        self.register_buffer("q", q.contiguous())
        assert scale is not None
        self.register_buffer("scale", scale.reshape(self.out_features, -1).half().contiguous())
        self.register_buffer("mins", None if mins is None
                             else mins.reshape(self.out_features, -1).half().contiguous())
        self.bias = None if bias is None else nn.Parameter(bias.detach().float(),
                                                           requires_grad=False)
        self.ops: Any = None  # the compiled CPU ops; None: torch (widens per call)

    @classmethod
    def int4(cls, linear: nn.Linear, group: int) -> BlockQuantLinear:
        q, scale, mins = quantize_int4(linear.weight.detach(), group)
        return cls(BlockFormat("int4", INT4, group), q, scale, mins, linear.bias)

    @classmethod
    def int8_blocks(cls, linear: nn.Linear) -> BlockQuantLinear:
        """8-bit blocks of 32 (Q8_0's format) with fp32 activations."""
        q, scale = quantize_int8_blocks(linear.weight.detach())
        return cls(BlockFormat("int8_blocks", INT8, BLOCK), q, scale, None, linear.bias)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size()
                   for t in (self.q, self.scale, self.mins) if t is not None)

    def dequantized_weight(self) -> torch.Tensor:
        if self.fmt.kquant:
            return kquant.dequantize(self.fmt.kind, self.q)
        return dequantize(self.fmt.kind, self.q, self.scale, self.mins, self.fmt.group)

    def dequantize_rows(self, row_ids: torch.Tensor) -> torch.Tensor:
        """Rows `row_ids` of the weight as fp32 [len(row_ids), in_features] (a token
        embedding kept in blocks looks its tokens up with this)."""
        ids = row_ids.reshape(-1).long()
        if self.fmt.kquant:
            q = self.q.index_select(0, ids)
            if self.ops is not None:
                return self.ops.kquant_dequantize(self.fmt.kind, q, 0, q.shape[0], None)
            return kquant.dequantize(self.fmt.kind, q)
        mins = None if self.mins is None else self.mins.index_select(0, ids)
        return dequantize(self.fmt.kind, self.q.index_select(0, ids),
                          self.scale.index_select(0, ids), mins, self.fmt.group)

    def _widen(self, start: int, end: int, buf: torch.Tensor) -> torch.Tensor:
        """Weight rows [start, end) as fp32, in `buf`."""
        if self.fmt.kquant:
            return self.ops.kquant_dequantize(self.fmt.kind, self.q, start, end, buf)
        return self.ops.block_dequantize(self.fmt.kind, self.q, self.scale, self.mins,
                                         self.fmt.group, start, end, buf)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        if self.ops is None:  # no compiled ops: the same arithmetic in torch
            xin = x2.float()
            if self.fmt.kquant:
                xin = kquant.activations_as_computed(xin)
            elif self.fmt.int8_activations:
                xin = quantize_activations(xin)
            out = F.linear(xin, self.dequantized_weight(), self.bias).to(x.dtype)
        elif self.fmt.kquant:
            out = self.ops.kquant_linear(x2.contiguous(), self.fmt.kind, self.q, self.bias)
        elif x2.shape[0] <= SMALL_BATCH or (self.fmt.int8_activations and self.fmt.group == BLOCK
                                            and _int8_tiles(self.ops)):
            out = self.ops.block_linear(x2.contiguous(), self.fmt.kind, self.q, self.scale,
                                        self.mins, self.fmt.group, self.bias,
                                        self.fmt.int8_activations)
        else:
            out = self._tiled(x2)
        return out.reshape(*x.shape[:-1], self.out_features)

    def _tiled(self, x2: torch.Tensor) -> torch.Tensor:
        """Large batches: a few hundred weight rows at a time widened into one reused buffer,
        then multiplied through torch's GEMM."""
        xf = x2.float().contiguous()
        if self.fmt.kquant:  # the same activations as the small-batch kernel
            xf = kquant.activations_as_computed(xf)
        elif self.fmt.int8_activations:
            xf = quantize_activations(xf)
        rows = max(16, TILE_ELEMENTS // self.in_features)
        buf = _tile_buffer(min(rows, self.out_features) * self.in_features)
        if rows >= self.out_features:  # the whole layer in one tile
            w = self._widen(0, self.out_features, buf)
            return _gemm(xf, w, self.bias).to(x2.dtype)
        out = torch.empty(xf.shape[0], self.out_features, dtype=torch.float32)
        for start in range(0, self.out_features, rows):
            end = min(start + rows, self.out_features)
            w = self._widen(start, end, buf)
            out[:, start:end] = _gemm(xf, w, None if self.bias is None else
                                      self.bias[start:end])
        return out.to(x2.dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"{self.fmt.name} (group {self.fmt.group})")


def _int8_tiles(ops: Any) -> bool:
    """Whether the compiled ops take prefill-sized batches on int8 activations in their own
    integer tiles (the AVX-512 build on a CPU with VNNI, csrc/block_tile.h; the AVX2 build,
    block_tile_avx2.h)."""
    tiles = getattr(ops, "block_int8_tiles", None)
    return tiles is not None and bool(tiles())


def _gemm(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ w.T (+ bias) in fp32: oneDNN's matmul where torch has it (on the AMD EPYC this
    project measures on, about twice MKL's fp32 GEMM at these shapes: linear.py), else torch's."""
    if _ONEDNN:
        return torch.ops.mkldnn._linear_pointwise(x, w, bias, "none", [], "")
    return F.linear(x, w, bias)


_ONEDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
_BUFFERS: dict[int, torch.Tensor] = {}


def _tile_buffer(numel: int) -> torch.Tensor:
    """One fp32 scratch buffer per size class, reused by every layer (the engine is one
    thread; tensor-parallel ranks are separate processes)."""
    size = 1 << max(0, (numel - 1).bit_length())
    buf = _BUFFERS.get(size)
    if buf is None:
        buf = _BUFFERS[size] = torch.empty(size, dtype=torch.float32)
    return buf
