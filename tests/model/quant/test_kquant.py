"""GGUF K-quants (Q4_K, Q5_K, Q6_K) computed in their super-blocks (model/quant/kquant.py,
csrc/kquant_linear.cpp), against gguf-py's own dequantization (gguf.quants, an independent
reference) on random valid super-blocks:
- the dequantization, torch's and every ISA build's, is gguf-py's bit for bit; the tests' own
  quantizer makes valid blocks near the weights; every build quantizes the activations as
  torch does;
- the kernel of every ISA build this CPU runs, M = 1..16 and a prefill size, odd N, K a
  multiple of 256, against two references in float64: W (gguf-py) times x, whose distance is
  bounded by the int8 rounding of the activations: each x_j moves by at most half a step,
  d_b / 2 = max|x in its 256| / 254, so |err| <= sum_b (d_b / 2) sum_{j in b} |w_j|; and W
  times the activations as the kernel quantized them, where only fp32 rounding remains
  (bounded here by 1e-5 of sum |w_j xq_j d_b|, measured ~5e-8);
- the prefill tiles (8 rows and more), and the AMX tiles (48 rows and more, where the CPU has
  amx-int8), giving each row the bits it gets alone;
- extreme values, and the kernel's errors on bad input.
The repacked blocks, the layers and a tiny model in K-quants: test_kquant_layers.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from octavo.model.quant import kquant
from octavo.model.quant.block_quant import SMALL_BATCH
from tests.model.quant.block_quant_helpers import ISAS, ops_for
from tests.model.quant.kquant_blocks import GGML_NAMES, quantize, random_blocks
from tests.model.quant.kquant_helpers import IDS, KINDS, check_against_references, gguf_dequantize

# ---- dequantization ------------------------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS, ids=IDS)
def test_dequantize_is_gguf_pys_bit_for_bit(kind):
    rng = np.random.default_rng(kind)
    raw = random_blocks(kind, 9, 768, rng)
    want = gguf_dequantize(kind, raw)
    q = kquant.repack(kind, torch.from_numpy(raw))
    assert torch.equal(kquant.dequantize(kind, q), want)
    for isa in ISAS:
        ops = ops_for(isa)
        assert torch.equal(ops.kquant_dequantize(kind, q, 0, 9, None), want)
        buf = torch.full((9 * 768,), float("nan"))
        got = ops.kquant_dequantize(kind, q, 2, 7, buf)
        assert got.data_ptr() == buf.data_ptr() and torch.equal(got, want[2:7])


def test_quantizer_makes_blocks_close_to_the_weights():
    """The tests' own quantizer (kquant_blocks.py): valid super-blocks near the weights."""
    rng = np.random.default_rng(1)
    w = (rng.standard_normal((6, 512)) * 0.02).astype(np.float32)
    for kind, levels in ((kquant.Q4_K, 15), (kquant.Q5_K, 31), (kquant.Q6_K, 63)):
        back = gguf_dequantize(kind, quantize(kind, w)).numpy()
        assert np.abs(back - w).max() < 2 * np.abs(w).max() / levels, GGML_NAMES[kind]


@pytest.mark.parametrize("isa", ISAS)
def test_activation_quantization_is_the_kernels(isa):
    """Every build's quantizer (AVX-512, AVX2 and plain loops) gives torch's values: the same
    scales, the same round-half-to-even of the same fp32 products, the same sums of 16."""
    ops = ops_for(isa)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(5, 768, generator=gen) * 3
    x[1, :256] = 0  # an all-zero super-block: scale 0
    x[2, :256] = torch.arange(256) * 0.5 - 64  # scale 127 / 64: +-32 give +-63.5, halfway
    x[3, 256:512] = -torch.linspace(0, 1, 256)  # -0.0 and a negative maximum
    q, d, sums = ops.kquant_quantize_x(x)
    want_q, want_d = kquant.quantize_activations(x)
    assert torch.equal(q, want_q) and torch.equal(d, want_d)
    assert torch.equal(sums, want_q.reshape(5, -1, 16).sum(-1).to(torch.int16))
    assert q.abs().max() == 127 and d[1, 0] == 0 and q[1, :256].eq(0).all()


# ---- the kernel ----------------------------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS, ids=IDS)
@pytest.mark.parametrize("isa", ISAS)
def test_kernel_against_gguf_dequantized_matmul(isa, kind):
    ops = ops_for(isa)
    rng = np.random.default_rng(10 * kind + ISAS.index(isa))
    gen = torch.Generator().manual_seed(kind)
    for n, k in ((37, 256), (5, 768)):
        raw = random_blocks(kind, n, k, rng)
        q, w = kquant.repack(kind, torch.from_numpy(raw)), gguf_dequantize(kind, raw)
        bias = torch.randn(n, generator=gen)
        for m in (*range(1, SMALL_BATCH + 1), 64):
            x = torch.randn(m, k, generator=gen) * 2
            b = bias if m % 2 else None
            got = ops.kquant_linear(x, kind, q, b)
            assert got.dtype == torch.float32 and got.shape == (m, n)
            check_against_references(got, x, w, b)
        xb = torch.randn(3, k, generator=gen).bfloat16()  # computed in fp32, returned in bf16
        got = ops.kquant_linear(xb, kind, q, bias)
        assert got.dtype == torch.bfloat16
        want = ops.kquant_linear(xb.float(), kind, q, bias)
        assert torch.equal(got, want.bfloat16())


@pytest.mark.parametrize("kind", KINDS, ids=IDS)
@pytest.mark.parametrize("isa", ISAS)
def test_prefill_tiles_give_each_rows_bits(isa, kind):
    """Batches of 8 rows and more run through the prefill tiles (kquant_tile.h: 8 activation
    rows interleaved per super-block, the weights in L2-sized chunks); each row's result must be
    the bits that row gives alone (the decode path), the rows after the last full tile included,
    and rows of zeros, of one huge value and of tiny values. N = 300 crosses a weight chunk."""
    ops = ops_for(isa)
    rng = np.random.default_rng(20 + kind)
    gen = torch.Generator().manual_seed(20 + kind)
    n, k, m = 300, 1280, 27
    raw = random_blocks(kind, n, k, rng)
    q = kquant.repack(kind, torch.from_numpy(raw))
    bias = torch.randn(n, generator=gen)
    x = torch.randn(m, k, generator=gen)
    x[3] = 0.0
    x[9, 17] = 1e4
    x[16:24] *= 1e-3
    alone = torch.cat([ops.kquant_linear(x[i:i + 1], kind, q, bias) for i in range(m)])
    for rows in (8, 9, 16, m):
        assert torch.equal(ops.kquant_linear(x[:rows], kind, q, bias), alone[:rows]), rows
    check_against_references(alone, x, gguf_dequantize(kind, raw), bias)


@pytest.mark.parametrize("kind", KINDS, ids=IDS)
def test_amx_tiles_give_each_rows_bits(kind):
    """Where the CPU has amx-int8, batches of 48 rows and more take AMX tiles (kquant_amx.h:
    16 activation rows x 16 weight rows per tile, the fp32 steps in AVX-512) for their whole
    tiles of 16 rows; each row's result must be the bits it gives alone and the bits of the
    same batch without AMX, the rows after the last tile (67 = 4 x 16 + 3) and a partial weight
    tile (300 = 18 x 16 + 12 rows, across chunks of 64) included, with and without a bias."""
    ops = ops_for("avx512") if "avx512" in ISAS else None
    if ops is None or not ops.kquant_has_amx():
        pytest.skip("this CPU (or kernel) does not give octavo amx-int8")
    rng = np.random.default_rng(30 + kind)
    gen = torch.Generator().manual_seed(30 + kind)
    n, k, m = 300, 1280, 67
    raw = random_blocks(kind, n, k, rng)
    q = kquant.repack(kind, torch.from_numpy(raw))
    x = torch.randn(m, k, generator=gen)
    x[3] = 0.0
    x[9, 17] = 1e4
    x[40:50] *= 1e-3
    for bias in (torch.randn(n, generator=gen), None):
        alone = torch.cat([ops.kquant_linear(x[i:i + 1], kind, q, bias) for i in range(m)])
        assert ops.kquant_set_amx(True) is True  # on by default
        with_amx = ops.kquant_linear(x, kind, q, bias)
        assert ops.kquant_set_amx(False) is True
        try:
            assert ops.kquant_kernel() == "avx512_vnni"
            without = ops.kquant_linear(x, kind, q, bias)
        finally:
            assert ops.kquant_set_amx(True) is False
        assert ops.kquant_kernel() == "avx512_vnni+amx_int8"
        assert torch.equal(with_amx, alone) and torch.equal(without, alone)
        check_against_references(alone, x, gguf_dequantize(kind, raw), bias)


@pytest.mark.parametrize("isa", ISAS)
def test_kernel_on_extreme_values(isa):
    """Every code at its extreme with the largest scales and full-range activations: the
    integer sums must neither saturate (vpmaddubsw's int16 pairs) nor overflow; 48 rows take
    the AMX tiles where the CPU has them."""
    ops = ops_for(isa)
    k = 512
    x = torch.full((3, k), 100.0)
    x[1] = -100.0
    x[1, ::3] = 100.0
    x = x.repeat(16, 1)
    for kind in KINDS:
        raw = np.full((4, k // 256 * kquant.FILE_BYTES[kind]), 255, np.uint8)
        raw[1::2] = np.where(np.arange(raw.shape[1]) % 2, 0, 255).astype(np.uint8)
        size = kquant.FILE_BYTES[kind]
        blocks = raw.reshape(4, -1, size)
        at = 208 if kind == kquant.Q6_K else 0
        blocks[..., at:at + 2] = np.frombuffer(np.float16(1e-3).tobytes(), np.uint8)
        if kind == kquant.Q6_K:
            blocks[2, :, 192:208] = 0x80  # scale -128
        else:
            blocks[..., 2:4] = np.frombuffer(np.float16(1e-3).tobytes(), np.uint8)
        raw = blocks.reshape(4, -1)
        got = ops.kquant_linear(x, kind, kquant.repack(kind, torch.from_numpy(raw)), None)
        check_against_references(got, x, gguf_dequantize(kind, raw), None)


def test_kernel_rejects_bad_input():
    ops = ops_for(ISAS[0])
    raw = random_blocks(kquant.Q4_K, 4, 512, np.random.default_rng(3))
    q = kquant.repack(kquant.Q4_K, torch.from_numpy(raw))
    x = torch.randn(2, 512)
    with pytest.raises(RuntimeError, match=r"x must be \[M, 512\]"):
        ops.kquant_linear(torch.randn(2, 256), kquant.Q4_K, q, None)
    with pytest.raises(RuntimeError, match="kind must be 2 \\(Q4_K\\), 3 \\(Q5_K\\) or 4"):
        ops.kquant_linear(x, 1, q, None)
    with pytest.raises(RuntimeError, match="not whole super-blocks of 180 bytes"):
        ops.kquant_linear(x, kquant.Q5_K, q, None)
    with pytest.raises(RuntimeError, match="contiguous uint8"):
        ops.kquant_linear(x, kquant.Q4_K, q.view(torch.int8), None)
    with pytest.raises(RuntimeError, match="bias must be"):
        ops.kquant_linear(x, kquant.Q4_K, q, torch.zeros(3))
    with pytest.raises(RuntimeError, match="rows out of range"):
        ops.kquant_dequantize(kquant.Q4_K, q, 3, 5, None)
    with pytest.raises(RuntimeError, match="multiple of 256"):
        ops.kquant_quantize_x(torch.randn(2, 100))
