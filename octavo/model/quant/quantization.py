"""Quantized weights (`quantization=`, vLLM's name), applied at load from an fp32/bf16 model:
`int8` here, `int4` in 4-bit blocks (block_quant.py); `gguf` keeps a GGUF file's own blocks
(gguf_weights.py).

`int8`: W8A8. Each linear layer's weight is quantized per output channel (symmetric, scale =
max |w| / 127 over the row) once at load; at run time each token's activations are quantized
with their own scale (dynamic, per token, symmetric) and the product runs on int8 x int8 ->
int32 through `torch._int_mm`, which on CPU is oneDNN's int8 GEMM: VNNI (vpdpbusd) where the
CPU has AVX512-VNNI or AVX-VNNI, AVX2's vpmaddubsw elsewhere, chosen by oneDNN from the CPU's
flags at run time (ONEDNN_MAX_CPU_ISA caps it; the tests force AVX2 that way). The AVX2 kernel
saturates int16 pair sums with full-range weights, so there weights take 7 bits (+-63;
`weight_qmax` measures which applies). The int32 sums are then exact; the output is
sum * x_scale[token] * w_scale[channel] (+ bias), in fp32, then the model dtype.

Every linear layer is quantized: the decoder layers' four projections and the LM head (as
llama.cpp's Q8_0 files quantize their output tensor; on SmolLM2-135M the LM head is a fifth of
the weights, and quantizing it took decode from 1.8x to 2.5x fp32 for a mean KL of 0.039
instead of 0.032: BENCHMARKS.md section 14). A tied LM head gets its own int8 copy; the
embedding lookup stays in the model dtype, as do norms and the KV cache: paging, prefix caching
and sampling are unchanged.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
from functools import cache
from typing import Any

import torch
from torch import nn

from octavo.model.quant.block_quant import BlockQuantLinear

logger = logging.getLogger(__name__)

METHODS = ("int8", "int4", "gguf")
INT4_GROUPS = (32, 64, 128)


def quantize_rows(x: torch.Tensor, qmax: int = 127) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per row: (q [rows, cols] int8 in [-qmax, qmax], scale [rows, 1] fp32),
    x ~ q * scale."""
    x = x.float()
    scale = x.abs().amax(dim=-1, keepdim=True).clamp_min(1e-12) / float(qmax)
    q = torch.round(x / scale).clamp_(-qmax, qmax).to(torch.int8)
    return q, scale


@cache
def weight_qmax() -> int:
    """The widest weight range whose int8 GEMM is exact on this CPU: 127 where oneDNN takes
    a VNNI kernel (vpdpbusd sums into int32), 63 where it takes AVX2's vpmaddubsw, whose
    pairwise int16 sums saturate past 32767 with full-range weights (255 x 127 x 2 > 32767;
    255 x 63 x 2 is not): fbgemm's "reduce range". Measured, not guessed from the flags: one
    worst-case product decides."""
    exact = True
    for x in (127, -127):  # oneDNN shifts s8 sources to u8 (+128): both ends of that range
        for w in (127, -127):
            a = torch.full((1, 64), x, dtype=torch.int8)
            b = torch.full((8, 64), w, dtype=torch.int8)
            exact &= torch.equal(torch._int_mm(a, b.t()), a.int() @ b.t().int())
    qmax = 127 if exact else 63
    logger.info("int8 GEMM on this CPU: weights in [-%d, %d]", qmax, qmax)
    return qmax


class Int8Linear(nn.Module):
    """W8A8 linear: int8 weight [out, in] with per-channel scales; activations quantized per
    token at run time."""

    def __init__(self, weight_q: torch.Tensor, weight_scale: torch.Tensor,
                 bias: torch.Tensor | None) -> None:
        super().__init__()
        self.ops: Any = None  # compiled CPU ops: the fused quantize and epilogue
        self.in_features, self.out_features = weight_q.shape[1], weight_q.shape[0]
        self.register_buffer("weight_q", weight_q)  # [out, in] int8; _int_mm takes its .t()
        self.register_buffer("weight_scale", weight_scale.reshape(1, -1).float())  # [1, out]
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Int8Linear:
        if linear.in_features < 2:  # torch._int_mm is wrong for K = 1 (seen in 2.13)
            raise ValueError("int8 linear layers need at least 2 input features")
        q, scale = quantize_rows(linear.weight.detach(), weight_qmax())
        return cls(q, scale, linear.bias)

    def dequantized_weight(self) -> torch.Tensor:
        """The fp32 weight this layer computes with (the tests' reference)."""
        return self.weight_q.float() * self.weight_scale.reshape(-1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        if self.ops is not None:  # compiled quantize pass, int8 GEMV/GEMM and epilogue
            out = self.ops.int8_linear(x2, self.weight_q, self.weight_scale, self.bias)
        else:
            xq, xs = quantize_rows(x2)
            acc = torch._int_mm(xq, self.weight_q.t())  # [tokens, out] int32, exact
            out = acc.to(torch.float32).mul_(xs).mul_(self.weight_scale)
            if self.bias is not None:
                out.add_(self.bias.float())
            out = out.to(x.dtype)
        return out.reshape(*x.shape[:-1], self.out_features)


@dataclass(frozen=True, slots=True)
class QuantReport:
    method: str
    layers: int
    bytes_before: int  # the quantized layers' weights in the model dtype (not tied ones)
    bytes_after: int  # their int8 weights and scales

    @property
    def saved_bytes(self) -> int:
        return self.bytes_before - self.bytes_after


def quantize_model(model: nn.Module, method: str, ops: Any = None,
                   skip: tuple[str, ...] = (), group: int = 32) -> QuantReport:
    """Replace the model's nn.Linear layers (except those named in `skip`) by `method`'s
    layers, in place; `ops`: the compiled CPU ops they use (None: torch).

    int8: W8A8 layers (Int8Linear) everywhere. int4: the decoder layers' projections in 4-bit
    blocks of `group` weights (block_quant.py, fp32 activations); the LM head, which int4
    hurts most (llama.cpp's Q4 files keep their output tensor in 6 or 8 bits too), in 8-bit
    blocks of 32. gguf is applied from the GGUF file itself (gguf_weights.py)."""
    if method not in METHODS or method == "gguf":
        raise ValueError(f"quantization={method!r} is not one of {METHODS[:2]}")
    if method == "int4" and group not in INT4_GROUPS:
        raise ValueError(f"int4 group size {group} is not one of {INT4_GROUPS}")
    targets = [(parent, name, child) for parent in model.modules()
               for name, child in parent.named_children()
               if type(child) is nn.Linear and name not in skip and child.in_features > 1]
    # a weight another module also holds (a tied LM head's is the embedding's) stays in memory
    holders = Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    before = after = 0
    layers = 0
    for parent, name, child in targets:
        q: nn.Module
        if method == "int8":
            q = Int8Linear.from_linear(child)
            size = q.weight_q.numel() + q.weight_scale.numel() * 4
        else:
            if child.in_features % 32:
                continue  # not whole blocks: stays in the model dtype
            q = (BlockQuantLinear.int8_blocks(child) if name == "lm_head"
                 else BlockQuantLinear.int4(child, group if child.in_features % group == 0
                                            else 32))
            size = q.nbytes()
        q.ops = ops
        if holders[id(child.weight)] == 1:
            before += child.weight.numel() * child.weight.element_size()
        after += size
        layers += 1
        setattr(parent, name, q)
    report = QuantReport(method, layers, before, after)
    logger.info("quantization %s: %d linear layers, weights %.1f MiB -> %.1f MiB (%.1f MiB "
                "saved)", method, report.layers, before / 2**20, after / 2**20,
                report.saved_bytes / 2**20)
    return report


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's weights in memory: parameters, int8 weights and scales, 4/8-bit
    blocks, and the oneDNN-packed copies that replace nn.Linear weights
    (PackedLinear.packed)."""
    seen: set[int] = set()
    total = 0
    for module in model.modules():
        tensors = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
        packed = getattr(module, "packed", None)
        if isinstance(packed, torch.Tensor):
            tensors.append(packed)
        for t in tensors:
            if id(t) not in seen and (t.is_floating_point()
                                      or t.dtype in (torch.int8, torch.uint8)):
                seen.add(id(t))
                total += t.numel() * t.element_size()
    return total
