"""packed_gemv (csrc/packed_gemv.cpp): decode-sized linear layers read in place from oneDNN's
packed weights. It equals F.linear on every build this CPU runs, a row's result depends
neither on the other rows nor on the thread count, the layout check refuses a layout it does
not read, and an engine that takes it gives HF's tokens (the exactness suites cover the rest)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from octavo.model import linear
from octavo.model.cpu_isa import supported_isas
from octavo.model.cpu_ops import load_cpu_ops
from octavo.model.linear import PackedLinear, gemv_layout, gemv_layout_of, onednn_usable

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
    """The kernel on a buffer laid out as it reads (gemv_layout_of, K padded to 16 / 32 as
    oneDNN pads it), whatever oneDNN does on this CPU; and on oneDNN's own buffer where the
    layout check finds that layout."""
    ops = load_cpu_ops(isa)
    want_rows = {"avx512": 32, "avx2": 16, "portable": 0}[isa]
    assert ops.packed_gemv_max_rows(torch.float32) == want_rows
    assert ops.packed_gemv_max_rows(torch.bfloat16) == (
        24 if ops.packed_gemv_supports(torch.bfloat16) else 0)
    n, k = shape
    for dtype in _dtypes(ops):
        layer = _layer(n, k, dtype, bias)
        bias_t = None if layer.bias is None else layer.bias.detach()
        pad = 32 if dtype == torch.bfloat16 else 16
        k_own = -(-k // pad) * pad
        own = gemv_layout_of(n, k, k_own, dtype, layer.weight.detach())
        buffers = [(own.data_ptr(), k_own)]
        packed = PackedLinear(layer)
        k_onednn = gemv_layout(n, k, dtype)
        if k_onednn is not None:
            buffers.append((torch.ops.mkldnn.data_ptr(packed.packed), k_onednn))
        for rows in (1, 2, 3, 4, 5, 6, 7, 13, 20):  # tiles of 6 rows (AVX-512) and the rest
            x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(dtype)
            want = F.linear(x.double(), layer.weight.double(),
                            None if bias_t is None else bias_t.double())
            results = [ops.packed_gemv(x, ptr, n, kp, bias_t) for ptr, kp in buffers]
            for got in results:
                assert got.dtype == dtype and got.shape == (rows, n)
                torch.testing.assert_close(got.double(), want, **TOL[dtype])
            assert all(torch.equal(r, results[0]) for r in results)  # the same sums


def test_a_row_does_not_depend_on_the_batch_or_the_threads():
    ops = load_cpu_ops()
    threads = torch.get_num_threads()
    for dtype in _dtypes(ops):
        n, k = 576, 1536  # K in several chunks, added in a fixed order
        packed = PackedLinear(_layer(n, k, dtype, True))
        assert packed.use_gemv(ops)
        x = torch.randn(min(20, ops.packed_gemv_max_rows(dtype)), k).to(dtype)
        batch = packed(x)
        try:
            torch.set_num_threads(1)
            for r in range(x.shape[0]):
                assert torch.equal(packed(x[r:r + 1]), batch[r:r + 1])
        finally:
            torch.set_num_threads(threads)


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
    monkeypatch.setenv(linear.GEMV_ENV_VAR, "0")
    assert not packed.use_gemv(ops) and packed.gemv_rows == 0 and packed.gemv_args() == (0,) * 4


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
    k_padded = gemv_layout(128, 64, torch.float32)
    assert k_padded == 64  # the real layout passes
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


def test_unsupported_calls_are_refused():
    ops = load_cpu_ops()
    if not ops.packed_gemv_max_rows(torch.float32):
        pytest.skip("this build leaves every layer to oneDNN")
    packed = PackedLinear(_layer(64, 32, torch.float32, False))
    ptr = torch.ops.mkldnn.data_ptr(packed.packed)
    with pytest.raises(RuntimeError, match="1 to 64 rows"):
        ops.packed_gemv(torch.randn(65, 32), ptr, 64, 32, None)
    with pytest.raises(RuntimeError, match="Double is not computed"):
        ops.packed_gemv(torch.randn(1, 32, dtype=torch.float64), ptr, 64, 32, None)
    with pytest.raises(RuntimeError, match="bias must be"):
        ops.packed_gemv(torch.randn(1, 32), ptr, 64, 32, torch.zeros(3))


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
