"""Key smoothing for quantized KV pages (kv_smoothing.py): exact before rounding, and it takes a
model's few large key channels out of the quantization.

- The Hadamard matrix is symmetric and orthonormal; other head sizes are refused.
- Attention with smoothed q, k and v, its output turned back, equals attention with the
  originals in fp32 (any offset, GQA, any positions): a per-query shift of the scores and a
  rotation change nothing.
- Keys with a few channels far larger than the rest (as Qwen2.5's K bias makes them): with
  smoothing, int8 and fp8 pages give attention several times closer to model-dtype attention.
- The engine: int8 and fp8 layers get their offsets and rotation from the calibration prompt,
  `kv_smooth_keys=False` gives none, soft-capped layers are only rotated, checkpoint fp8 scales
  leave keys as computed, and the cache's id differs with and without, so KV tier records of
  one are never read into the other. End to end, on a tiny model whose K projection has a large
  bias, smoothing brings int8 pages' logits closer to model-dtype pages'.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from octavo import LLM
from octavo.bench.quant import sequence_logits
from octavo.model.layers.decoder import Attention
from octavo.model.layers.kv_quant import dequantize, kv_format, quantize
from octavo.model.layers.kv_smoothing import hadamard, rotatable, smooth_qkv, unrotate
from tests.conftest import build_tiny_llama


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Dense causal GQA attention in fp32: q [T, H, D], k/v [T, KH, D] -> [T, H, D]."""
    t, heads, d = q.shape
    group = heads // k.shape[1]
    kk, vv = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = torch.einsum("ihd,jhd->hij", q, kk) / d**0.5
    s = s.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("hij,jhd->ihd", s.softmax(-1), vv)


@pytest.mark.parametrize("n", [1, 2, 16, 64, 128, 256])
def test_hadamard_is_symmetric_and_orthonormal(n):
    h = hadamard(n)
    assert torch.equal(h, h.T)
    torch.testing.assert_close(h @ h, torch.eye(n), atol=1e-6, rtol=0)
    assert rotatable(n) == (n > 1)


@pytest.mark.parametrize("n", [0, 3, 80, 96])
def test_other_head_sizes_are_refused(n):
    assert not rotatable(n)
    with pytest.raises(ValueError, match="power-of-two"):
        hadamard(n)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), t=st.integers(1, 24), kv_heads=st.sampled_from([1, 2]),
       group=st.sampled_from([1, 3, 4]), log_d=st.integers(1, 6), offset=st.booleans(),
       rotate=st.booleans())
def test_smoothing_is_exact_before_rounding(seed, t, kv_heads, group, log_d, offset, rotate):
    gen = torch.Generator().manual_seed(seed)
    d = 2**log_d
    q = torch.randn(t, kv_heads * group, d, generator=gen, dtype=torch.float64)
    k = torch.randn(t, kv_heads, d, generator=gen, dtype=torch.float64) * 3
    v = torch.randn(t, kv_heads, d, generator=gen, dtype=torch.float64)
    m = torch.randn(kv_heads, d, generator=gen, dtype=torch.float64) * 50 if offset else None
    h = hadamard(d, torch.float64) if rotate else None
    qs, ks, vs = smooth_qkv(q, k, v, m, h)
    assert qs.dtype == q.dtype and ks.dtype == k.dtype and vs.dtype == v.dtype
    torch.testing.assert_close(unrotate(attend(qs, ks, vs), h), attend(q, k, v), atol=1e-9,
                               rtol=1e-9)


def outlier_keys(gen: torch.Generator, t: int, kv_heads: int, d: int) -> torch.Tensor:
    """Keys of spread ~1 with four channels per head offset by ~100 (a large K bias)."""
    k = torch.randn(t, kv_heads, d, generator=gen)
    k[:, :, [1, 5, d // 2 + 1, d - 3]] += torch.tensor([120.0, -90.0, 75.0, 100.0])
    return k


@pytest.mark.parametrize("name", ["int8", "fp8_e4m3"])
def test_smoothing_takes_large_key_channels_out_of_the_rounding(name):
    gen = torch.Generator().manual_seed(11)
    t, kv_heads, group, d = 96, 2, 4, 128
    q = torch.randn(t, kv_heads * group, d, generator=gen) * 0.3
    k = outlier_keys(gen, t, kv_heads, d)
    v = torch.randn(t, kv_heads, d, generator=gen)
    fmt = kv_format(name, torch.float32)
    exact = attend(q, k, v)

    def stored(x: torch.Tensor, fp8_range: float) -> torch.Tensor:
        scale = x.abs().amax(dim=(0, 2)) / fp8_range if fmt.is_fp8 else None  # calibration's
        return dequantize(quantize(x, fmt, scale), fmt, scale)

    def error(out: torch.Tensor) -> float:
        return float((out - exact).norm() / exact.norm())

    plain = error(attend(q, stored(k, 200), v))  # the keys' rounding alone
    # the calibration's offset: the mean over other tokens of the same distribution
    m = outlier_keys(torch.Generator().manual_seed(12), t, kv_heads, d).mean(0)
    h = hadamard(d)
    qs, ks, vs = smooth_qkv(q, k, v, m, h)
    smoothed = error(unrotate(attend(qs, stored(ks, 200), vs), h))
    assert smoothed * 3 < plain, (name, smoothed, plain)


def kv_layers(llm: LLM) -> list[Attention]:
    return [m for m in llm.engine.runner.model.modules() if isinstance(m, Attention)]


def test_the_engine_smooths_int8_and_fp8_keys_and_keeps_caches_apart(tiny_llama_dir):
    ids = {}
    for name, smooth in (("int8", True), ("int8", False), ("fp8_e4m3", True)):
        llm = LLM(str(tiny_llama_dir), kv_cache_dtype=name, kv_smooth_keys=smooth,
                  num_kv_blocks=16)
        for layer in kv_layers(llm):
            q = layer.kv_quant
            assert (q.k_offset is not None) == smooth and (q.rotation is not None) == smooth
            if smooth:
                assert q.k_offset.shape == (2, 16)  # this model's KV heads x head_dim
                assert torch.equal(q.rotation, hadamard(16))
        ids[name, smooth] = llm.engine.runner.kv_cache.scales_id
    assert ids["int8", False] == ""  # int8 pages without smoothing: as they always were
    assert len(set(ids.values())) == 3


def test_soft_capped_layers_are_rotated_not_centred(tmp_path):
    from tests.model.models.test_gemma import build

    llm = LLM(str(build(tmp_path / "gemma2", "gemma2")), kv_cache_dtype="int8",
              num_kv_blocks=16)
    layers = kv_layers(llm)
    assert layers and all(m.softcap is not None for m in layers)
    for m in layers:
        assert m.kv_quant.k_offset is None and m.kv_quant.rotation is not None


def test_checkpoint_fp8_scales_leave_keys_as_computed(tmp_path):
    model_dir = build_tiny_llama(tmp_path / "fp8-scales")
    file = model_dir / "model.safetensors"
    tensors = load_file(file)
    for i in range(2):
        tensors[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(0.05)
        tensors[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(0.02)
    save_file(tensors, file, metadata={"format": "pt"})
    llm = LLM(str(model_dir), kv_cache_dtype="fp8", num_kv_blocks=16)
    for m in kv_layers(llm):
        assert m.kv_quant.k_offset is None and m.kv_quant.rotation is None


def test_a_large_key_bias_costs_smoothed_int8_pages_less(tmp_path):
    """A tiny Llama whose K projection adds ~30-60 to a few channels of every head: the logits
    of a teacher-forced sequence through int8 pages, against model-dtype pages, with and
    without smoothing (prefill and the C++ decode loop both write the pages)."""
    model_dir = build_tiny_llama(tmp_path / "kbias", attention_bias=True)
    file = model_dir / "model.safetensors"
    tensors = load_file(file)
    for i in range(2):
        bias = torch.zeros(2, 16)
        bias[:, [2, 7, 10, 15]] = torch.tensor([40.0, -60.0, 30.0, 50.0])
        tensors[f"model.layers.{i}.self_attn.k_proj.bias"] = bias.flatten()
    save_file(tensors, file, metadata={"format": "pt"})
    tokens = [(i * 37 + 11) % 250 + 3 for i in range(120)]
    ref = sequence_logits(LLM(str(model_dir), num_kv_blocks=16), tokens).log_softmax(-1)

    def kl(smooth: bool) -> float:
        llm = LLM(str(model_dir), kv_cache_dtype="int8", kv_smooth_keys=smooth,
                  num_kv_blocks=16)
        out = sequence_logits(llm, tokens).log_softmax(-1)
        return float((ref.exp() * (ref - out)).sum(-1).mean())

    smoothed, plain = kl(True), kl(False)
    assert smoothed * 3 < plain, (smoothed, plain)
