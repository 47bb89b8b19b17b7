"""The compiled CPU ops equal the torch code they replace (octavo/model/models/llama.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from octavo.model.kernels.cpu_ops import load_cpu_ops
from octavo.model.layers.decoder import RMSNorm, apply_rope

ops = load_cpu_ops()
pytestmark = pytest.mark.skipif(ops is None, reason="compiled CPU ops unavailable")

DTYPES = [torch.float32, torch.bfloat16]
# fp32: different summation order and exp; bf16: the same roundings as torch, so at most one
# bf16 step apart where an fp32 intermediate lands on a rounding boundary.
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=1e-2, rtol=1e-2)}


def _norm(hidden: int, dtype: torch.dtype) -> RMSNorm:
    norm = RMSNorm(hidden, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(hidden, generator=torch.Generator().manual_seed(1)) + 0.5)
    return norm.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden", [(1, 576), (37, 576), (5, 100)])
def test_rms_norm(dtype, rows, hidden):
    x = (torch.randn(rows, hidden, generator=torch.Generator().manual_seed(0)) * 3).to(dtype)
    norm = _norm(hidden, dtype)
    want = norm(x)
    got = ops.rms_norm(x, norm.weight.detach(), norm.eps)
    torch.testing.assert_close(got, want, **TOL[dtype])
    if dtype == torch.bfloat16:  # almost every element is bit-identical
        assert (got != want).float().mean() < 0.01


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_updates_the_residual_in_place(dtype):
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(9, 576, generator=gen).to(dtype)
    residual = torch.randn(9, 576, generator=gen).to(dtype)
    norm = _norm(576, dtype)
    want_residual = residual + x
    want = norm(want_residual)
    got = ops.add_rms_norm_(x, residual, norm.weight.detach(), norm.eps)
    assert torch.equal(residual, want_residual)  # one rounding, as torch's add
    torch.testing.assert_close(got, want, **TOL[dtype])
    # the torch fallback takes the same path
    residual2 = want_residual - x
    torch.testing.assert_close(norm.add_forward(x, residual2.clone()), want, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 2, 16), (2, 2, 128)])
def test_rope_in_place_on_qkv(dtype, heads, kv_heads, head_dim):
    tokens = 11
    gen = torch.Generator().manual_seed(3)
    width = (heads + 2 * kv_heads) * head_dim
    qkv = torch.randn(tokens, width, generator=gen).to(dtype)
    positions = torch.randint(0, 4000, (tokens,), generator=gen)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = positions[:, None].float() * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    c, s = cos.to(dtype)[:, None, :], sin.to(dtype)[:, None, :]
    want_q, want_k = apply_rope(q, c, s), apply_rope(k, c, s)
    v_before = qkv[:, (heads + kv_heads) * head_dim :].clone()
    ops.rope_(qkv, cos, sin, heads, kv_heads, head_dim)
    torch.testing.assert_close(q, want_q, **TOL[dtype])
    torch.testing.assert_close(k, want_k, **TOL[dtype])
    assert torch.equal(qkv[:, (heads + kv_heads) * head_dim :], v_before)  # v untouched


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(dtype):
    gen = torch.Generator().manual_seed(4)
    gate_up = (torch.randn(13, 2 * 1536, generator=gen) * 6).to(dtype)
    gate, up = gate_up.split(1536, dim=-1)
    want = F.silu(gate) * up
    torch.testing.assert_close(ops.silu_and_mul(gate_up), want, **TOL[dtype])


def test_silu_extremes_stay_finite():
    x = torch.tensor([[-1000.0, -90.0, -1e-30, 0.0, 1e-30, 90.0, 1000.0, 1.0]])
    gate_up = torch.cat([x, torch.ones_like(x)], dim=1)
    torch.testing.assert_close(ops.silu_and_mul(gate_up), F.silu(x), atol=1e-6, rtol=1e-6)


def test_bad_shapes_are_refused():
    with pytest.raises(RuntimeError, match="weight must be"):
        ops.rms_norm(torch.randn(2, 8), torch.ones(4), 1e-5)
    with pytest.raises(RuntimeError, match="too narrow"):
        ops.rope_(torch.randn(2, 8), torch.ones(2, 4), torch.ones(2, 4), 2, 1, 4)
    with pytest.raises(RuntimeError, match="gate_up"):
        ops.silu_and_mul(torch.randn(2, 7))
