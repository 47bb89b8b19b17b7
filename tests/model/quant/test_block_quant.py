"""The compiled kernels of the 4-bit, 5-bit and 8-bit blocks (csrc/block_linear.cpp), every
ISA build this CPU runs, against a dequantize-then-matmul reference (odd row and column counts:
the kernel tiles activation rows by 1/2/4/8 and weight rows by 1/2/4), on fp32 and on int8
activations: a row alone has the bits it has in any batch, Q5_0 computes as its bytes in 8-bit
blocks, extreme values neither saturate nor overflow, the widening used by the large-batch
path (block_dequantize) is dequantize()'s bit for bit, and bad input is refused."""

from __future__ import annotations

import pytest
import torch

from octavo.model.quant.block_quant import (
    INT4,
    INT5,
    INT8,
    dequantize,
    pack_fives,
    pack_nibbles,
    unpack_fives,
)
from tests.model.quant.block_quant_helpers import (
    ISAS,
    assert_matches,
    ops_for,
    random_weights,
    reference,
)

# ---- the kernel ------------------------------------------------------------------------------

KINDS = {"int4-g32": (INT4, 32, (32, 96, 288)), "int4-g128": (INT4, 128, (128, 384)),
         "int8": (INT8, 32, (32, 96, 288)), "q5_0": (INT5, 32, (32, 96, 288))}
ROWS = (1, 2, 3, 4, 5, 7, 8, 9, 16)
COLS = (1, 3, 37, 100)


@pytest.mark.parametrize("int8_activations", [False, True], ids=["fp32-act", "int8-act"])
@pytest.mark.parametrize("fmt", list(KINDS))
@pytest.mark.parametrize("isa", ISAS)
def test_block_linear_kernel_equals_dequantized_matmul(isa, fmt, int8_activations):
    ops = ops_for(isa)
    kind, group, ks = KINDS[fmt]
    gen = torch.Generator().manual_seed(
        100 * ISAS.index(isa) + 10 * list(KINDS).index(fmt) + int8_activations)
    for k in ks:
        for n in COLS:
            q, scale, mins = random_weights(kind, n, k, group, gen)
            bias = torch.randn(n, generator=gen)
            for m in ROWS:
                x = torch.randn(m, k, generator=gen) * 2
                for b in (None, bias):
                    got = ops.block_linear(x, kind, q, scale, mins, group, b, int8_activations)
                    assert got.dtype == torch.float32 and got.shape == (m, n)
                    want = reference(kind, q, scale, mins, group, x, b, int8_activations)
                    assert_matches(got, want)
            # bf16 activations: computed in fp32, returned in bf16
            xb = torch.randn(5, k, generator=gen).bfloat16()
            got = ops.block_linear(xb, kind, q, scale, mins, group, bias, int8_activations)
            assert got.dtype == torch.bfloat16 and got.shape == (5, n)
            want = reference(kind, q, scale, mins, group, xb.float(), bias, int8_activations)
            assert_matches(got, want, atol_frac=1e-2, rtol=1e-2)


@pytest.mark.parametrize("fmt", list(KINDS))
@pytest.mark.parametrize("isa", ISAS)
def test_one_row_has_the_bits_of_a_batch_row(isa, fmt):
    """On int8 activations a row alone (a decode of one sequence, which has a kernel of its
    own: idot1) gives the same bits as the same row inside batches of 2..9: batching never
    changes a sequence's logits."""
    ops = ops_for(isa)
    kind, group, ks = KINDS[fmt]
    gen = torch.Generator().manual_seed(7 + list(KINDS).index(fmt))
    for k in ks:
        for n in (1, 2, 5, 37, 301):  # odd counts: the kernels' one-row tails
            q, scale, mins = random_weights(kind, n, k, group, gen)
            bias = torch.randn(n, generator=gen)
            x = torch.randn(9, k, generator=gen) * 2
            for b in (None, bias):
                batch = ops.block_linear(x, kind, q, scale, mins, group, b, True)
                for i in (0, 4, 8):
                    alone = ops.block_linear(x[i : i + 1], kind, q, scale, mins, group, b, True)
                    assert torch.equal(alone[0], batch[i]), (k, n, i)
                    for m in (2, 3, 5):  # smaller batches holding row i
                        rows = x[max(0, i - m + 1) : max(0, i - m + 1) + m]
                        part = ops.block_linear(rows, kind, q, scale, mins, group, b, True)
                        assert torch.equal(alone[0], part[i - max(0, i - m + 1)]), (k, n, i, m)


@pytest.mark.parametrize("int8_activations", [False, True], ids=["fp32-act", "int8-act"])
@pytest.mark.parametrize("isa", ISAS)
def test_q5_0_computes_as_its_bytes_in_8_bit_blocks(isa, int8_activations):
    """A 5-bit block is unpacked to its signed bytes and computed as the 8-bit kind computes
    them: the same bits, at every batch size (its files once loaded as those 8-bit blocks)."""
    ops = ops_for(isa)
    gen = torch.Generator().manual_seed(12)
    for n, k in ((37, 288), (5, 640), (1, 32)):
        q, scale, _ = random_weights(INT5, n, k, 32, gen)
        q8 = unpack_fives(q)
        for m in (1, 2, 5, 9, 16):
            x = torch.randn(m, k, generator=gen)
            five = ops.block_linear(x, INT5, q, scale, None, 32, None, int8_activations)
            eight = ops.block_linear(x, INT8, q8, scale, None, 32, None, int8_activations)
            assert torch.equal(five, eight), (n, k, m)
        assert torch.equal(ops.block_dequantize(INT5, q, scale, None, 32, 0, n, None),
                           ops.block_dequantize(INT8, q8, scale, None, 32, 0, n, None))


@pytest.mark.parametrize("isa", ISAS)
def test_block_linear_kernel_on_extreme_values(isa):
    """Every nibble / byte value, full-range activations (the int8 path's integer sums must not
    saturate), negative mins and a zero row of x."""
    ops = ops_for(isa)
    n, k = 9, 256
    q4 = torch.arange(n * k, dtype=torch.int64).remainder(16).reshape(n, k).to(torch.uint8)
    scale = torch.full((n, k // 32), 0.0625, dtype=torch.float16)
    mins = torch.full((n, k // 32), -0.5, dtype=torch.float16)
    q8 = torch.full((n, k), 127, dtype=torch.int8)
    q8[::2] = -127
    x = torch.full((3, k), 100.0)
    x[1] = -100.0
    x[2] = 0.0
    for int8_activations in (False, True):
        got = ops.block_linear(x, INT4, pack_nibbles(q4), scale, mins, 32, None,
                               int8_activations)
        assert_matches(got, reference(INT4, pack_nibbles(q4), scale, mins, 32, x, None,
                                      int8_activations))
        got = ops.block_linear(x, INT8, q8, scale, None, 32, None, int8_activations)
        assert_matches(got, reference(INT8, q8, scale, None, 32, x, None, int8_activations))
        assert got[2].eq(0).all()
        for v in (-16, 15):  # 5-bit extremes: every weight at one end, and all 32 values
            q5 = torch.full((n, k), v, dtype=torch.int64)
            q5[1::2] = torch.arange(k).remainder(32) - 16
            got = ops.block_linear(x, INT5, pack_fives(q5), scale, None, 32, None,
                                   int8_activations)
            assert_matches(got, reference(INT5, pack_fives(q5), scale, None, 32, x, None,
                                          int8_activations))
            assert got[2].eq(0).all()


@pytest.mark.parametrize("fmt", list(KINDS))
@pytest.mark.parametrize("isa", ISAS)
def test_block_dequantize_rows_equal_dequantize(isa, fmt):
    """The widened rows are exactly dequantize()'s: q * scale is exact in fp32 (4 or 7 bits
    times float16's 11), so a fused multiply-add rounds like the separate ones."""
    ops = ops_for(isa)
    kind, group, ks = KINDS[fmt]
    gen = torch.Generator().manual_seed(7)
    n, k = 37, ks[-1]
    q, scale, mins = random_weights(kind, n, k, group, gen)
    full = dequantize(kind, q, scale, mins, group)
    assert torch.equal(ops.block_dequantize(kind, q, scale, mins, group, 0, n, None), full)
    buf = torch.full((40 * k,), float("nan"))
    for begin, end in ((0, n), (3, 20), (n - 1, n), (17, 17), (0, 1)):
        got = ops.block_dequantize(kind, q, scale, mins, group, begin, end, None)
        assert got.shape == (end - begin, k) and torch.equal(got, full[begin:end])
        into = ops.block_dequantize(kind, q, scale, mins, group, begin, end, buf)
        if end > begin:  # a view of the buffer, from its start
            assert into.data_ptr() == buf.data_ptr()
        assert torch.equal(into, full[begin:end])
        assert torch.equal(buf[: (end - begin) * k].reshape(end - begin, k), full[begin:end])


# ---- bad input ---------------------------------------------------------------------------------

def test_kernel_rejects_bad_input():
    ops = ops_for(ISAS[0])
    gen = torch.Generator().manual_seed(6)
    q, scale, mins = random_weights(INT4, 8, 64, 32, gen)
    q8, scale8, _ = random_weights(INT8, 8, 64, 32, gen)
    x = torch.randn(2, 64, generator=gen)
    with pytest.raises(RuntimeError, match=r"x must be \[M, 64\]"):
        ops.block_linear(torch.randn(2, 96), INT4, q, scale, mins, 32, None, False)
    with pytest.raises(RuntimeError, match=r"x must be \[M, 64\]"):
        ops.block_linear(torch.randn(64), INT4, q, scale, mins, 32, None, False)
    for group in (48, 96, 16, 0):
        with pytest.raises(RuntimeError, match="group must be 32, 64, 128"):
            ops.block_linear(x, INT4, q, scale, mins, group, None, False)
        with pytest.raises(RuntimeError, match="group must be 32, 64, 128"):
            ops.block_dequantize(INT8, q8, scale8, None, group, 0, 8, None)
    with pytest.raises(RuntimeError, match=r"K \(64\) must be a multiple of group \(128\)"):
        ops.block_linear(x, INT4, q, scale, mins, 128, None, False)
    with pytest.raises(RuntimeError, match=r"scale must be float16 \[N, K/group\]"):
        ops.block_linear(x, INT4, q, scale[:, :1].contiguous(), mins, 32, None, False)
    with pytest.raises(RuntimeError, match=r"scale must be float16 \[N, K/group\]"):
        ops.block_linear(x, INT4, q, scale.float(), mins, 32, None, False)
    with pytest.raises(RuntimeError, match="4-bit weights need float16 mins"):
        ops.block_linear(x, INT4, q, scale, None, 32, None, False)
    with pytest.raises(RuntimeError, match="4-bit weights need float16 mins"):
        ops.block_linear(x, INT4, q, scale, mins[:4].contiguous(), 32, None, False)
    with pytest.raises(RuntimeError, match="4-bit q must be uint8"):
        ops.block_linear(x, INT4, q.view(torch.int8), scale, mins, 32, None, False)
    with pytest.raises(RuntimeError, match="8-bit q must be int8"):
        ops.block_linear(x, INT8, q8.view(torch.uint8), scale8, None, 32, None, False)
    q5, scale5, _ = random_weights(INT5, 8, 64, 32, gen)
    with pytest.raises(RuntimeError, match="5-bit q must be uint8"):
        ops.block_linear(x, INT5, q5.view(torch.int8), scale5, None, 32, None, False)
    with pytest.raises(RuntimeError, match=r"5-bit q must be \[N, K/32 \* 20\] bytes"):
        ops.block_linear(x, INT5, q5[:, :39].contiguous(), scale5, None, 32, None, False)
    with pytest.raises(RuntimeError, match=r"5-bit q must be \[N, K/32 \* 20\] bytes"):
        ops.block_dequantize(INT5, q5, scale5, None, 64, 0, 8, None)
    with pytest.raises(RuntimeError, match="kind must be 0"):
        ops.block_linear(x, 2, q8, scale8, None, 32, None, False)
    with pytest.raises(RuntimeError, match="bias must be"):
        ops.block_linear(x, INT8, q8, scale8, None, 32, torch.zeros(7), False)
    with pytest.raises(RuntimeError, match="rows out of range"):
        ops.block_dequantize(INT8, q8, scale8, None, 32, 4, 9, None)
    with pytest.raises(RuntimeError, match="rows out of range"):
        ops.block_dequantize(INT8, q8, scale8, None, 32, 5, 4, None)
    with pytest.raises(RuntimeError, match="out must be a contiguous float32 buffer"):
        ops.block_dequantize(INT8, q8, scale8, None, 32, 0, 8, torch.empty(8 * 64 - 1))
