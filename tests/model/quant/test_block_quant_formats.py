"""The bytes of the 4-bit, 5-bit and 8-bit blocks (model/quant/block_quant.py): the nibble
layout (GGUF's order, by hand) and the 5-bit one (against gguf-py's Q5_0), and the quantizers:
int4 groups and 8-bit blocks within half a step of the weights, and the activations rounded to
int8 exactly as the compiled kernel rounds them."""

from __future__ import annotations

import pytest
import torch

from octavo.model.quant.block_quant import (
    BLOCK,
    INT4,
    INT8,
    dequantize,
    pack_fives,
    pack_nibbles,
    quantize_activations,
    quantize_int4,
    quantize_int8_blocks,
    unpack_fives,
    unpack_nibbles,
)
from tests.model.quant.block_quant_helpers import kernel_activations

# ---- nibbles ---------------------------------------------------------------------------------

def test_pack_unpack_nibbles_round_trip():
    gen = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (5, 96), generator=gen, dtype=torch.uint8)
    packed = pack_nibbles(q)
    assert packed.dtype == torch.uint8 and packed.shape == (5, 48) and packed.is_contiguous()
    assert torch.equal(unpack_nibbles(packed), q)
    raw = torch.randint(0, 256, (3, 64), generator=gen, dtype=torch.uint8)
    assert torch.equal(pack_nibbles(unpack_nibbles(raw)), raw)  # every byte value


def test_nibble_order_is_ggufs():
    """Element j of a block of 32 is the low nibble of byte j, element j + 16 the high one."""
    lo = [(3 * j + 1) % 16 for j in range(16)]
    hi = [(5 * j + 2) % 16 for j in range(16)]
    block2 = [15 - v for v in lo + hi]  # a second block: bytes 16..31
    q = torch.tensor([lo + hi + block2], dtype=torch.uint8)
    want = [lo[j] | (hi[j] << 4) for j in range(16)]
    want += [block2[j] | (block2[j + 16] << 4) for j in range(16)]
    assert pack_nibbles(q).tolist() == [want]
    # by hand: byte 0x21 holds element 0 = 1 (low) and element 16 = 2 (high)
    one = torch.zeros(1, 32, dtype=torch.uint8)
    one[0, 0], one[0, 16], one[0, 15], one[0, 31] = 1, 2, 14, 15
    packed = pack_nibbles(one)
    assert packed[0, 0].item() == 0x21 and packed[0, 15].item() == 0xFE
    assert packed[0, 1:15].eq(0).all()
    assert unpack_nibbles(packed).tolist() == one.tolist()


# ---- quantizers --------------------------------------------------------------------------------

@pytest.mark.parametrize("group", [32, 64, 128])
def test_quantize_int4_is_within_half_a_step(group):
    gen = torch.Generator().manual_seed(group)
    n, k = 7, 384
    w = torch.randn(n, k, generator=gen) * 0.1 + torch.linspace(-0.2, 0.3, k)
    w[2, :group] = 0.25  # a constant group: scale 0, w = min
    q, scale, mins = quantize_int4(w, group)
    assert q.dtype == torch.uint8 and q.shape == (n, k // 2)
    assert scale.dtype == mins.dtype == torch.float16
    assert scale.shape == mins.shape == (n, k // group)
    values = unpack_nibbles(q)
    assert int(values.max()) <= 15 and int(values.min()) >= 0
    assert int(values.max()) == 15  # the range is used
    back = dequantize(INT4, q, scale, mins, group)
    err = (back - w).abs().reshape(n, k // group, group).amax(dim=-1)
    # round to nearest against the float16 scale: half a step, plus float16's rounding of the
    # min (and of the scale times the largest q) in the group's magnitude
    mag = w.abs().reshape(n, k // group, group).amax(dim=-1)
    bound = scale.float() / 2 + 16 * 2.0**-11 * mag + 1e-6
    assert (err <= bound).all(), (err - bound).max()
    assert torch.equal(back[2, :group], torch.full((group,), 0.25).half().float())


def test_quantize_int8_blocks_is_within_half_a_step():
    gen = torch.Generator().manual_seed(1)
    n, k = 5, 160
    w = torch.randn(n, k, generator=gen) * 3
    w[1, 32:64] = 0  # an all-zero block: scale 0, q 0
    q, scale = quantize_int8_blocks(w)
    assert q.dtype == torch.int8 and q.shape == (n, k)
    assert scale.dtype == torch.float16 and scale.shape == (n, k // BLOCK)
    assert int(q.abs().max()) <= 127
    assert (q.reshape(n, -1, BLOCK).abs().amax(dim=-1)[scale > 0] >= 126).all()
    assert scale[1, 1].item() == 0 and q[1, 32:64].eq(0).all()
    back = dequantize(INT8, q, scale, None, BLOCK)
    err = (back - w).abs().reshape(n, k // BLOCK, BLOCK).amax(dim=-1)
    # half a step, plus the float16 rounding of the scale times q (at most 127)
    mag = w.abs().reshape(n, k // BLOCK, BLOCK).amax(dim=-1)
    bound = scale.float() / 2 + 2.0**-11 * mag + 1e-6
    assert (err <= bound).all(), (err - bound).max()


def test_quantize_activations_is_the_kernels_rounding():
    """quantize_activations (the torch fallback's and the tiled path's) rounds exactly as the
    kernel's quantize_x: x * (127 / amax) with a true division."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(256, 1024, generator=gen) * 2
    assert torch.equal(quantize_activations(x), kernel_activations(x))


def test_quantize_activations_matches_the_block_formula():
    x = torch.tensor([[0.5] * 31 + [-1.27] + [0.0] * 32])
    xq = quantize_activations(x)
    dx = 1.27 / 127
    assert torch.allclose(xq[0, :32], torch.round(x[0, :32] / dx) * dx)
    assert xq[0, 32:].eq(0).all()  # an all-zero block stays zero (no division by 0)


# ---- 5-bit blocks ------------------------------------------------------------------------------

def test_fives_pack_and_unpack_as_ggufs_q5_0():
    """The 5-bit blocks hold the file's bytes (low nibbles, then the fifth bits, bit j for
    element j), and unpack to x - 16: checked against the gguf package's Q5_0 dequantization
    with a scale of 1."""
    import gguf.quants
    from gguf import GGMLQuantizationType

    gen = torch.Generator().manual_seed(11)
    x = torch.randint(-16, 16, (6, 128), generator=gen)
    x[0, :32] = torch.arange(-16, 16)  # every value at every position's parity
    q = pack_fives(x)
    assert q.dtype == torch.uint8 and q.shape == (6, 128 // 32 * 20)
    assert torch.equal(unpack_fives(q), x.to(torch.int8))
    blocks = q.reshape(6, 4, 20)
    one = torch.tensor([1.0], dtype=torch.float16).view(torch.uint8).expand(6, 4, 2)
    raw = torch.cat([one, blocks[..., 16:], blocks[..., :16]], dim=-1).reshape(6, -1).numpy()
    theirs = gguf.quants.dequantize(raw, GGMLQuantizationType.Q5_0)
    assert torch.equal(torch.from_numpy(theirs.astype("float32")), x.float())
