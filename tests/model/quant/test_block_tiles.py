"""The integer tiles that compute prefill-sized batches of the 32-weight formats on int8
activations (GGUF's Q8_0, Q5_0, Q4_0/Q4_1 at 17 rows or more: csrc/block_tile.h in the AVX-512
build on a CPU with avx512_vnni, block_tile_avx2.h in the AVX2 build and in the AVX-512 build
without it, `avx512-no-vnni` here, its VNNI tiles turned off), each build this CPU runs:
against the dequantize-then-matmul reference on the kernel's own quantized activations, against
the register kernels row by row, on extreme values, and a row's bits in batches of any size the
tiles take."""

from __future__ import annotations

import pytest
import torch

from octavo.model.kernels.cpu_isa import cpu_flags
from octavo.model.quant import block_quant
from octavo.model.quant.block_quant import (
    INT4,
    INT5,
    INT8,
    BlockFormat,
    BlockQuantLinear,
    pack_nibbles,
)
from tests.model.quant.block_quant_helpers import (
    ISAS,
    assert_matches,
    ops_for,
    random_weights,
    reference,
)

KINDS = {"q4_1": INT4, "q8_0": INT8, "q5_0": INT5}
TILE_ROWS = (17, 18, 21, 64)  # 17: the first batch the tiles take; MT = 4 tiles and 1-row tails


TILE_ISAS = [isa for isa in ISAS if isa != "portable"]
# each tile path: the builds, and the AVX-512 build on the AVX2 tiles (a CPU without VNNI's)
TILE_PATHS = [*TILE_ISAS, *(["avx512-no-vnni"] if "avx512" in ISAS else [])]


@pytest.fixture(autouse=True)
def _vnni_tiles_back_on():
    yield
    if "avx512" in ISAS:
        ops_for("avx512").block_tiles_set_vnni(True)


def tiles_ops(path: str):
    isa, _, variant = path.partition("-")
    ops = ops_for(isa)
    if isa == "avx512":
        ops.block_tiles_set_vnni(variant != "no-vnni")
    if not ops.block_int8_tiles():
        pytest.skip(f"the {isa} build has no integer tiles")
    return ops


def test_which_builds_have_the_tiles():
    for isa in ISAS:
        ops = ops_for(isa)
        assert ops.block_int8_tiles() == (isa != "portable"), isa
    if "avx512" in ISAS:
        ops = ops_for("avx512")
        vnni = "avx512_vnni" in cpu_flags()
        assert ops.block_tiles_path() == ("avx512_vnni" if vnni else "avx2")
        assert ops.block_tiles_set_vnni(False) is True  # on by default
        assert ops.block_tiles_path() == "avx2"
        assert ops.block_tiles_set_vnni(True) is False
        assert ops.block_tiles_path() == ("avx512_vnni" if vnni else "avx2")
    if "avx2" in ISAS:
        assert ops_for("avx2").block_tiles_path() == "avx2"


@pytest.mark.parametrize("fmt", list(KINDS))
def test_the_avx512_build_without_vnni_gives_the_avx2_builds_bits(fmt):
    """On a CPU without avx512_vnni the AVX-512 build takes block_tile_avx2.h's tiles: the
    same integer sums and fp32 steps as the AVX2 build, so the same bits."""
    if not {"avx512", "avx2"} <= set(ISAS):
        pytest.skip("needs the AVX-512 and AVX2 builds")
    wide, narrow = tiles_ops("avx512-no-vnni"), tiles_ops("avx2")
    kind = KINDS[fmt]
    gen = torch.Generator().manual_seed(7 + list(KINDS).index(fmt))
    for k, n, m in ((288, 33, 17), (640, 130, 64), (1536, 17, 21)):
        q, scale, mins = random_weights(kind, n, k, 32, gen)
        x, bias = torch.randn(m, k, generator=gen) * 2, torch.randn(n, generator=gen)
        assert torch.equal(wide.block_linear(x, kind, q, scale, mins, 32, bias, True),
                           narrow.block_linear(x, kind, q, scale, mins, 32, bias, True))


@pytest.mark.parametrize("fmt", list(KINDS))
@pytest.mark.parametrize("isa", TILE_PATHS)
def test_tiles_equal_the_dequantized_matmul(isa, fmt):
    ops = tiles_ops(isa)
    kind = KINDS[fmt]
    gen = torch.Generator().manual_seed(31 + list(KINDS).index(fmt))
    # n: partial 16-row groups, a partial pair of groups, more than one 64-row chunk
    for k in (32, 288, 640, 1536):
        for n in (1, 15, 17, 33, 130):
            q, scale, mins = random_weights(kind, n, k, 32, gen)
            bias = torch.randn(n, generator=gen)
            for m in TILE_ROWS:
                x = torch.randn(m, k, generator=gen) * 2
                for b in (None, bias):
                    got = ops.block_linear(x, kind, q, scale, mins, 32, b, True)
                    assert got.shape == (m, n)
                    assert_matches(got, reference(kind, q, scale, mins, 32, x, b, True))
        xb = torch.randn(20, k, generator=gen).bfloat16()  # computed in fp32, returned in bf16
        got = ops.block_linear(xb, kind, q, scale, mins, 32, bias, True)
        assert got.dtype == torch.bfloat16
        assert_matches(got, reference(kind, q, scale, mins, 32, xb.float(), bias, True),
                       atol_frac=1e-2, rtol=1e-2)


@pytest.mark.parametrize("fmt", list(KINDS))
@pytest.mark.parametrize("isa", TILE_PATHS)
def test_tile_rows_agree_with_the_register_kernels_and_keep_their_bits(isa, fmt):
    """The tiles' integer sums are the register kernels' (only the fp32 sum order differs),
    and a row's result is the same bits in every batch the tiles take."""
    ops = tiles_ops(isa)
    kind = KINDS[fmt]
    gen = torch.Generator().manual_seed(41 + list(KINDS).index(fmt))
    n, k = 37, 640
    q, scale, mins = random_weights(kind, n, k, 32, gen)
    bias = torch.randn(n, generator=gen)
    x = torch.randn(40, k, generator=gen) * 3
    batch = ops.block_linear(x, kind, q, scale, mins, 32, bias, True)
    rows = torch.cat([ops.block_linear(x[i : i + 1], kind, q, scale, mins, 32, bias, True)
                      for i in range(40)])
    assert_matches(batch, rows, atol_frac=1e-5, rtol=1e-5)
    for lo, hi in ((0, 17), (3, 21), (19, 40), (10, 31)):
        part = ops.block_linear(x[lo:hi], kind, q, scale, mins, 32, bias, True)
        assert torch.equal(part, batch[lo:hi]), (lo, hi)


@pytest.mark.parametrize("isa", TILE_PATHS)
def test_tiles_on_extreme_values(isa):
    """Every byte value including -128 (its start, -128 * sum(w), and unsigned activations up
    to 255 must not overflow), full-range activations of both signs, 5-bit extremes, 4-bit
    codes with negative mins, and a zero activation row."""
    ops = tiles_ops(isa)
    n, k, m = 33, 512, 20
    x = torch.full((m, k), 100.0)
    x[1::2] = -100.0
    x[5] = 0.0
    x[7] = torch.linspace(-50, 50, k)
    q8 = (torch.arange(n * k) % 256 - 128).reshape(n, k).to(torch.int8)
    q8[0] = -128
    q8[1] = 127
    scale = torch.full((n, k // 32), 0.0625, dtype=torch.float16)
    got = ops.block_linear(x, INT8, q8, scale, None, 32, None, True)
    assert_matches(got, reference(INT8, q8, scale, None, 32, x, None, True))
    assert got[5].eq(0).all()
    for v in (-16, 15):
        q5 = torch.full((n, k), v, dtype=torch.int64)
        q5[1::2] = torch.arange(k).remainder(32) - 16
        q5p = block_quant.pack_fives(q5)
        got = ops.block_linear(x, INT5, q5p, scale, None, 32, None, True)
        assert_matches(got, reference(INT5, q5p, scale, None, 32, x, None, True))
    q4 = pack_nibbles(torch.arange(n * k).remainder(16).reshape(n, k))
    mins = torch.full((n, k // 32), -0.5, dtype=torch.float16)
    got = ops.block_linear(x, INT4, q4, scale, mins, 32, None, True)
    assert_matches(got, reference(INT4, q4, scale, mins, 32, x, None, True))


@pytest.mark.parametrize("isa", TILE_PATHS)
def test_block_linear_takes_prefill_batches_in_the_tiles(isa, monkeypatch):
    """BlockQuantLinear sends a GGUF 32-weight layer's prefill batch to the tiles, not through
    the widened weight rows + GEMM, where the compiled ops have them."""
    ops = tiles_ops(isa)
    gen = torch.Generator().manual_seed(5)
    q, scale, _ = random_weights(INT8, 48, 256, 32, gen)
    layer = BlockQuantLinear(BlockFormat("q8_0", INT8, 32, int8_activations=True), q, scale,
                             None, None)
    layer.ops = ops

    def widened(*_args, **_kw):
        raise AssertionError("the widened tiles ran")

    monkeypatch.setattr(BlockQuantLinear, "_tiled", widened)
    x = torch.randn(100, 256, generator=gen)
    assert_matches(layer(x), reference(INT8, q, scale, None, 32, x, None, True))
