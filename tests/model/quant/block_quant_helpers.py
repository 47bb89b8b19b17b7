"""Helpers shared by the 4-bit and 8-bit block tests (test_block_quant*.py, test_block_tiles.py,
test_kquant*.py): the ISA builds this CPU runs and their compiled ops, random weights in each
block kind, the kernel's own int8 rounding of the activations, the dequantize-then-matmul
reference, and the tolerance for fp32 sums taken in another order."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from octavo.model.kernels.cpu_isa import supported_isas
from octavo.model.kernels.cpu_ops import load_cpu_ops
from octavo.model.quant.block_quant import (
    BLOCK,
    INT4,
    INT5,
    dequantize,
    pack_fives,
    quantize_int4,
    quantize_int8_blocks,
)

ISAS = supported_isas()


def ops_for(isa: str):
    ops = load_cpu_ops(isa)
    if ops is None:
        pytest.skip(f"octavo's CPU ops ({isa}) cannot be built here")
    assert ops.isa() == isa
    return ops


def random_weights(kind: int, n: int, k: int, group: int, gen: torch.Generator):
    """(q, scale, mins) of a random [n, k] weight in `kind`'s blocks."""
    w = torch.randn(n, k, generator=gen)
    if kind == INT4:
        return quantize_int4(w, group)
    if kind == INT5:  # Q5_0: values in -16..15 (every one of them in a large enough weight)
        x = torch.randint(-16, 16, (n, k), generator=gen)
        return pack_fives(x), (torch.rand(n, k // 32, generator=gen) / 8).half(), None
    q, scale = quantize_int8_blocks(w)
    return q, scale, None


def assert_matches(got: torch.Tensor, ref: torch.Tensor, atol_frac: float = 1e-4,
                   rtol: float = 1e-5) -> None:
    """fp32 accumulation in another order: atol relative to the output's magnitude."""
    scale = ref.abs().max().item() if ref.numel() else 0.0
    torch.testing.assert_close(got.float(), ref.float(), atol=atol_frac * scale + 1e-6,
                               rtol=rtol)


def kernel_activations(x: torch.Tensor) -> torch.Tensor:
    """x as the compiled int8-activation kernel quantizes it (csrc/block_linear.cpp,
    quantize_x): xq = nearbyint(x * (127 / amax)), dx = amax / 127, in fp32, the quotient a
    true division. quantize_activations must round the same way
    (test_block_quant_formats.py, test_quantize_activations_is_the_kernels_rounding)."""
    m, k = x.shape
    blocks = x.float().reshape(m, k // BLOCK, BLOCK)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    # a true division (torch computes `127 / amax` as reciprocal(amax) * 127)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    return (torch.round(blocks * inv) * (amax / 127)).reshape(m, k)


def reference(kind, q, scale, mins, group, x, bias, int8_activations, act=kernel_activations):
    xin = act(x.float()) if int8_activations else x.float()
    return F.linear(xin, dequantize(kind, q, scale, mins, group), bias)
