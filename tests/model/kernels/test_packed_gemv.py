"""packed_gemv (csrc/packed_gemv.cpp): decode-sized linear layers read in place from oneDNN's
packed weights. It equals F.linear on every build this CPU runs, a row's result depends
neither on the other rows nor on the thread count, the layout check refuses a layout it does
not read, and an engine that takes it gives HF's tokens (the exactness suites cover the rest)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from octavo.model.kernels.cpu_isa import supported_isas
from octavo.model.kernels.cpu_ops import load_cpu_ops
from octavo.model.layers import linear
from octavo.model.layers.linear import (
    GEMV_BLOCKS,
    PackedLinear,
    gemv_layout,
    gemv_layout_of,
    onednn_usable,
)

pytestmark = pytest.mark.skipif(not onednn_usable(torch.float32) or load_cpu_ops() is None,
                                reason="needs oneDNN and the compiled CPU ops")
ISAS = supported_isas()
# (N, K): the embedded model's four layer shapes, and ragged ones (a partial block of 64
# outputs, K not a multiple of 16, fewer outputs than one block, one chunk or several)
SHAPES = [(960, 576), (576, 1536), (100, 70), (40, 24), (130, 31), (64, 33), (200, 1000)]
TOL = {torch.float32: dict(atol=2e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def _layer(n: int, k: int, dtype: torch.dtype, bias: bool) -> nn.Linear:
    torch.manual_seed(n * 7 + k)
    return nn.Linear(k, n, bias=bias).to(dtype).eval()


def _dtypes(ops) -> list[torch.dtype]:
    return [d for d in (torch.float32, torch.bfloat16)
            if ops.packed_gemv_supports(d) and onednn_usable(d)]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("bias", [False, True])
def test_equals_f_linear_on_every_build(isa, shape, bias):
    """The kernel on buffers laid out as it reads (gemv_layout_of in blocks of 64 and of 32
    outputs, K padded to 16 / 32 as oneDNN pads it), whatever oneDNN does on this CPU; and on
    oneDNN's own buffer where the layout check finds one of them. Every buffer gives the same
    sums."""
    ops = load_cpu_ops(isa)
    want_rows = {"avx512": 32, "avx2": 16, "portable": 0}[isa]
    assert ops.packed_gemv_max_rows(torch.float32) == want_rows
    bf16_rows = 24 if ops.packed_gemv_supports(torch.bfloat16) else 0
    assert ops.packed_gemv_max_rows(torch.bfloat16) == bf16_rows
    assert ops.packed_gemv_max_rows(torch.bfloat16, 32) == (
        16 if ops.packed_gemv_has_amx() else bf16_rows)
    n, k = shape
    for dtype in _dtypes(ops):
        layer = _layer(n, k, dtype, bias)
        bias_t = None if layer.bias is None else layer.bias.detach()
        pad = 32 if dtype == torch.bfloat16 else 16
        k_own = -(-k // pad) * pad
        own = [gemv_layout_of(n, k, k_own, dtype, layer.weight.detach(), block)
               for block in GEMV_BLOCKS]
        buffers = [(buf.data_ptr(), k_own, block)
                   for buf, block in zip(own, GEMV_BLOCKS, strict=True)]
        packed = PackedLinear(layer)
        onednn_layout = gemv_layout(n, k, dtype)
        if onednn_layout is not None:
            buffers.append((torch.ops.mkldnn.data_ptr(packed.packed), *onednn_layout))
        for rows in (1, 2, 3, 4, 5, 6, 7, 13, 20):  # tiles of 6 rows (AVX-512) and the rest
            x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(dtype)
            want = F.linear(x.double(), layer.weight.double(),
                            None if bias_t is None else bias_t.double())
            amx_was = ops.packed_gemv_set_amx(False)
            try:
                results = [ops.packed_gemv(x, ptr, n, kp, bias_t, block)
                           for ptr, kp, block in buffers]
            finally:
                ops.packed_gemv_set_amx(amx_was)
            # and with AMX tiles (blocks of 32 in bf16, on a CPU with AMX)
            amx = [ops.packed_gemv(x, ptr, n, kp, bias_t, block)
                   for ptr, kp, block in buffers if block == 32]
            for got in results + amx:
                assert got.dtype == dtype and got.shape == (rows, n)
                torch.testing.assert_close(got.double(), want, **TOL[dtype])
            assert all(torch.equal(r, results[0]) for r in results)  # the same sums
            assert all(torch.equal(r, amx[0]) for r in amx)


def test_a_row_does_not_depend_on_the_batch_or_the_threads():
    ops = load_cpu_ops()
    threads = torch.get_num_threads()
    for dtype in _dtypes(ops):
        n, k = 576, 1536  # K in several chunks, added in a fixed order
        packed = PackedLinear(_layer(n, k, dtype, True))
        assert packed.use_gemv(ops)
        x = torch.randn(min(20, packed.gemv_rows), k).to(dtype)
        batch = packed(x)
        try:
            torch.set_num_threads(1)
            for r in range(x.shape[0]):
                assert torch.equal(packed(x[r:r + 1]), batch[r:r + 1])
        finally:
            torch.set_num_threads(threads)


def test_amx_tiles_agree_with_vdpbf16ps():
    """Where oneDNN packs bf16 for AMX (blocks of 32) and the CPU has it, packed_gemv computes
    with AMX tiles at every row count (1 to 64: tiles of up to 16 rows, as even as can be); its
    sums differ from vdpbf16ps's only by rounding."""
    ops = load_cpu_ops()
    if not ops.packed_gemv_has_amx() or not onednn_usable(torch.bfloat16):
        pytest.skip("no AMX here")
    assert ops.packed_gemv_set_amx(True) is True  # on by default
    for n, k in ((960, 576), (576, 1536), (100, 70), (130, 96)):
        layer = _layer(n, k, torch.bfloat16, True)
        kp, block = gemv_layout(n, k, torch.bfloat16) or (None, None)
        packed = PackedLinear(layer)
        if block != 32:
            pytest.skip("oneDNN does not pack bf16 for AMX here")
        ptr, bias_t = torch.ops.mkldnn.data_ptr(packed.packed), layer.bias.detach()
        for rows in (1, 5, 16, 17, 40, 64):
            x = torch.randn(rows, k).bfloat16()
            tiles = ops.packed_gemv(x, ptr, n, kp, bias_t, 32)
            assert ops.packed_gemv_set_amx(False) is True
            try:
                dots = ops.packed_gemv(x, ptr, n, kp, bias_t, 32)
            finally:
                assert ops.packed_gemv_set_amx(True) is False
            want = F.linear(x.double(), layer.weight.double(), bias_t.double())
            torch.testing.assert_close(tiles.double(), want, **TOL[torch.bfloat16])
            torch.testing.assert_close(tiles.float(), dots.float(), atol=1e-2, rtol=1e-2)


def test_amx_tiles_leave_onednn_intact():
    """packed_gemv loads its own tile configuration and releases the tiles on every thread;
    oneDNN's AMX kernels, called in between, give the same bits as without it."""
    ops = load_cpu_ops()
    if not ops.packed_gemv_has_amx() or not onednn_usable(torch.bfloat16):
        pytest.skip("no AMX here")
    layers = [PackedLinear(_layer(n, k, torch.bfloat16, True)) for n, k in ((960, 576),
                                                                             (576, 1536))]
    if not all(p.use_gemv(ops) and p.gemv_block == 32 for p in layers):
        pytest.skip("oneDNN does not pack bf16 for AMX here")

    def onednn(p, x):
        return torch.ops.mkldnn._linear_pointwise(x, p.packed, p.bias, "none", [], "")

    xs = [torch.randn(m, p.in_features).bfloat16() for p in layers for m in (1, 16, 40, 100)]
    want = [onednn(p, x) for p in layers for x in xs if x.shape[1] == p.in_features]
    for _ in range(2):
        got = []
        for p in layers:
            for x in xs:
                if x.shape[1] == p.in_features:
                    p(x[:1]), p(x[:3])  # packed_gemv on AMX tiles in between
                    got.append(onednn(p, x))
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


def test_use_gemv_takes_small_batches_and_leaves_larger_ones_to_onednn(monkeypatch):
    ops = load_cpu_ops()
    packed = PackedLinear(_layer(300, 200, torch.float32, True))
    assert packed.use_gemv(ops) == (ops.packed_gemv_max_rows(torch.float32) > 0)
    calls = []
    real = ops.packed_gemv

    class Spy:
        def packed_gemv(self, *args):
            calls.append(args[0].shape[0])
            return real(*args)

    packed.ops = Spy()
    rows = packed.gemv_rows
    for m in (1, rows, rows + 1, rows + 40):
        x = torch.randn(m, 200)
        torch.testing.assert_close(packed(x), F.linear(x, *_weights(packed)), **TOL[torch.float32])
    assert calls == ([1, rows] if rows else [])
    assert ("packed_gemv up to" in repr(packed)) == bool(rows)
    assert not packed.use_gemv(ops, 0) and packed.gemv_rows == 0  # packed_gemv_rows=0: off
    assert packed.gemv_args() == (0, 0, 0, 0, 64)
    assert packed.use_gemv(ops, 3) == bool(rows) and packed.gemv_rows == min(rows, 3)
    with pytest.raises(ValueError, match="packed_gemv_rows must be >= 0"):
        packed.use_gemv(ops, -1)


def _weights(packed: PackedLinear) -> tuple[torch.Tensor, torch.Tensor | None]:
    return packed.packed.to_dense(), packed.bias


def test_a_layout_it_does_not_read_keeps_onednn(monkeypatch):
    """The layout is oneDNN's to choose: where the packed buffer is not the one packed_gemv
    reads (here: its blocks swapped), the check refuses it and oneDNN computes the layer."""
    real = linear._packed_view

    def shuffled(packed, dtype):
        view = real(packed, dtype).clone()
        return view.view(2, -1).flip(0).flatten()

    layer = _layer(128, 64, torch.float32, False)
    k_padded, block = gemv_layout(128, 64, torch.float32)
    assert (k_padded, block) == (64, 64)  # the real layout passes
    plain = layer.weight.detach()
    assert torch.equal(real(PackedLinear(layer).packed, torch.float32),
                       gemv_layout_of(128, 64, k_padded, torch.float32, plain))
    gemv_layout.cache_clear()
    monkeypatch.setattr(linear, "_packed_view", shuffled)
    try:
        assert gemv_layout(128, 64, torch.float32) is None
        packed = PackedLinear(layer)
        assert not packed.use_gemv(load_cpu_ops()) and packed.gemv_rows == 0
        x = torch.randn(1, 64)
        torch.testing.assert_close(packed(x), F.linear(x, layer.weight), **TOL[torch.float32])
    finally:
        gemv_layout.cache_clear()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_check_finds_blocks_of_32(monkeypatch, dtype):
    """oneDNN packs bf16 in blocks of 32 outputs where it uses AMX (64 elsewhere): a buffer in
    that layout (emulated here on any CPU) is found as (Kp, 32), and one in neither is not."""
    if not onednn_usable(dtype):
        pytest.skip(f"oneDNN does not pack {dtype} here")
    n, k, k_padded = 192, 96, 96
    monkeypatch.setattr(linear, "_packed_view", lambda packed, dt: gemv_layout_of(
        n, k, k_padded, dt, packed.to_dense(), 32))
    gemv_layout.cache_clear()
    try:
        assert gemv_layout(n, k, dtype) == (k_padded, 32)
        monkeypatch.setattr(linear, "_packed_view", lambda packed, dt: gemv_layout_of(
            n, k, k_padded, dt, packed.to_dense().flip(0), 32))
        gemv_layout.cache_clear()
        assert gemv_layout(n, k, dtype) is None
    finally:
        gemv_layout.cache_clear()


def test_unsupported_calls_are_refused():
    ops = load_cpu_ops()
    if not ops.packed_gemv_max_rows(torch.float32):
        pytest.skip("this build leaves every layer to oneDNN")
    packed = PackedLinear(_layer(64, 32, torch.float32, False))
    ptr = torch.ops.mkldnn.data_ptr(packed.packed)
    with pytest.raises(RuntimeError, match="1 to 64 rows"):
        ops.packed_gemv(torch.randn(65, 32), ptr, 64, 32, None, 64)
    with pytest.raises(RuntimeError, match="Double is not computed"):
        ops.packed_gemv(torch.randn(1, 32, dtype=torch.float64), ptr, 64, 32, None, 64)
    with pytest.raises(RuntimeError, match="bias must be"):
        ops.packed_gemv(torch.randn(1, 32), ptr, 64, 32, torch.zeros(3), 64)
    with pytest.raises(RuntimeError, match="blocks of 64 or 32 outputs, got 16"):
        ops.packed_gemv(torch.randn(1, 32), ptr, 64, 32, None, 16)


def test_engine_with_packed_gemv_reports_it_and_matches_hf(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    from octavo import LLM, SamplingParams
    from tests.engine.conftest import hf_greedy

    llm = LLM(model=str(tiny_llama_dir), dtype="float32")
    path = llm.engine.runner.kernel_path()
    rows = load_cpu_ops().packed_gemv_max_rows(torch.float32)
    assert path["decode_gemv"] == (f"packed_gemv <= {rows} rows" if rows else "off")
    prompts = [[1, 5, 9, 13, 2], [3, 4], list(range(20, 60))]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    got = [o.outputs[0].token_ids
           for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                 use_tqdm=False)]
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    assert got == hf_greedy(hf, prompts, 12)
