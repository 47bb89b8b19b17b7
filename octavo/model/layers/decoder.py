"""The layers decoder-only families share: RMSNorm, RoPE (with rope scaling), grouped-query
attention over the paged KV cache, the gated MLP and the pre-norm decoder layer.

Q/K/V and gate/up projections are fused into one matmul each (the families' checkpoints are
fused at load time where they come separate). The residual stream is carried beside each
layer's output (vLLM's convention), so that every residual add is fused with the RMSNorm that
follows it. On CPU, `ops` (set by the model's `use_cpu_ops`) switches RMSNorm (with its
residual add), RoPE and SiLU-and-mul to octavo's compiled ops (csrc/fused_ops.cpp), which
follow the same op order; the torch code here is the reference and the fallback.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from octavo.config import ModelConfig
from octavo.model.layers.attention.base import AttentionBackend
from octavo.model.layers.kv_quant import KVQuant


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.ops: Any = None  # compiled CPU ops, when enabled

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ops is not None:
            return self.ops.rms_norm(x, self.weight, self.eps)
        # Same op order as transformers' LlamaRMSNorm: statistics in fp32, scale in the model dtype.
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """residual += x (in place), then the norm of the new residual."""
        if self.ops is not None:
            return self.ops.add_rms_norm_(x, residual, self.weight, self.eps)
        residual.add_(x)
        return self.forward(residual)


def rope_inv_freq(config: ModelConfig) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and the attention scaling factor for the config's rope type."""
    dim = config.head_dim
    inv_freq = 1.0 / (
        config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    )
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq, 1.0
    rope_type = scaling.get("rope_type", scaling.get("type"))
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"]), 1.0
    if rope_type == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_len = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled), 1.0
    if rope_type == "longrope":  # Phi-3: the short factors (the long ones: longrope_long)
        return _longrope(config, "short_factor")
    if rope_type == "proportional":  # Gemma 4's global layers
        return _proportional(config, scaling), 1.0
    raise ValueError(f"rope scaling type {rope_type!r} is not supported (supported: default, "
                     "linear, llama3, longrope, proportional)")


def _proportional(config: ModelConfig, scaling: dict) -> torch.Tensor:
    """transformers' proportional RoPE: the first `partial_rotary_factor` of the frequencies
    (each over the whole head_dim), the rest 0, so their dimensions pass unrotated."""
    dim = config.head_dim
    angles = int(float(scaling.get("partial_rotary_factor", 1.0)) * dim // 2)
    rotated = 1.0 / (config.rope_theta ** (
        torch.arange(0, 2 * angles, 2, dtype=torch.int64).float() / dim))
    inv_freq = torch.cat((rotated, torch.zeros(dim // 2 - angles)))
    return inv_freq / float(scaling.get("factor", 1.0))


def _longrope_original(config: ModelConfig) -> int:
    scaling = config.rope_scaling or {}
    return int(scaling.get("original_max_position_embeddings")
               or config.hf.get("original_max_position_embeddings")
               or config.max_position_embeddings)


def _longrope(config: ModelConfig, which: str) -> tuple[torch.Tensor, float]:
    """LongRoPE (transformers' _compute_longrope_parameters): per-frequency factors, and an
    attention factor sqrt(1 + ln(factor) / ln(original)) on cos and sin."""
    scaling = config.rope_scaling or {}
    dim = config.head_dim
    original = _longrope_original(config)
    factor = scaling.get("factor") or config.max_position_embeddings / original
    attention = scaling.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    ext = torch.tensor(scaling[which], dtype=torch.float32)
    shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (ext * config.rope_theta**shape), float(attention)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position up to max_positions, indexed by each token's position."""

    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        super().__init__()
        inv_freq, attention_scaling = rope_inv_freq(config)
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]
        scaling = config.rope_scaling or {}
        if scaling.get("rope_type", scaling.get("type")) == "longrope":
            # positions past the original context rotate with the long factors (vLLM's choice;
            # transformers switches the whole batch once any sequence gets that long, so the two
            # agree below the original context, where the tests compare them)
            original = _longrope_original(config)
            if max_positions > original:
                long_freq, _ = _longrope(config, "long_factor")
                freqs[original:] = positions[original:, None] * long_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos() * attention_scaling, persistent=False)
        self.register_buffer("sin", emb.sin() * attention_scaling, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype, fp32_rows: bool = False):
        """cos and sin per token: [T, 1, head_dim] in the model dtype (transformers' cast), or
        with fp32_rows [T, head_dim] float32 for the compiled RoPE, which casts itself."""
        cos, sin = self.cos[positions], self.sin[positions]
        if fp32_rows:
            return cos, sin
        return cos.to(dtype)[:, None, :], sin.to(dtype)[:, None, :]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + _rotate_half(x) * sin


class Attention(nn.Module):
    """Grouped-query attention. `qk_norm` (Qwen3): an RMSNorm over each head of q and k,
    before RoPE."""

    def __init__(self, config: ModelConfig, qk_norm: bool = False) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.scale = config.head_dim**-0.5
        self.qkv_proj = nn.Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias
        )
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=config.o_proj_bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        # local attention over the last `window` keys, and the score soft cap (Gemma sets them)
        self.window: int | None = None
        self.softcap: float | None = None
        self.rope = True  # False: no rotary embedding on this layer (SmolLM3's NoPE layers)
        # quantized KV pages (kv_quant.py), set by the runner with the cache; None: model dtype
        self.kv_quant: KVQuant | None = None
        self.ops: Any = None  # compiled CPU ops, when enabled

    def _norm_heads(self, qkv: torch.Tensor) -> None:
        """q and k, head by head, through their norms, written back into qkv."""
        assert self.q_norm is not None and self.k_norm is not None
        q = qkv[:, : self.q_size].reshape(-1, self.head_dim)
        k = qkv[:, self.q_size : self.q_size + self.kv_size].reshape(-1, self.head_dim)
        qkv[:, : self.q_size] = self.q_norm(q).view(-1, self.q_size)
        qkv[:, self.q_size : self.q_size + self.kv_size] = self.k_norm(k).view(-1, self.kv_size)

    def forward(self, x, cos, sin, k_cache, v_cache, meta, backend: AttentionBackend):
        qkv = self.qkv_proj(x)
        if self.q_norm is not None:
            self._norm_heads(qkv)
        if self.ops is not None and self.rope:
            self.ops.rope_(qkv, cos, sin, self.num_heads, self.num_kv_heads, self.head_dim)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        if self.ops is None and self.rope:
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.kv_quant is not None:
            q, k, v = self.kv_quant.smooth(q, k, v)  # key smoothing (kv_smoothing.py), if any
            o = self.kv_quant.unsmooth(backend.forward(
                q, k, v, k_cache, v_cache, meta, self.scale, window=self.window,
                softcap=self.softcap, kv=self.kv_quant))
        elif self.window is None and self.softcap is None:
            o = backend.forward(q, k, v, k_cache, v_cache, meta, self.scale)
        else:
            o = backend.forward(q, k, v, k_cache, v_cache, meta, self.scale,
                                window=self.window, softcap=self.softcap)
        return self.o_proj(o.reshape(-1, self.q_size))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.intermediate = config.intermediate_size
        self.gate_up_proj = nn.Linear(
            config.hidden_size, 2 * config.intermediate_size, bias=config.mlp_bias
        )
        self.down_proj = nn.Linear(
            config.intermediate_size, config.hidden_size, bias=config.mlp_bias
        )
        self.ops: Any = None  # compiled CPU ops, when enabled

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.ops is not None:
            return self.down_proj(self.ops.silu_and_mul(gate_up))
        gate, up = gate_up.split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, qk_norm: bool = False) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, qk_norm=qk_norm)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, residual, cos, sin, k_cache, v_cache, meta, backend):
        """x: the previous layer's MLP output (or the embeddings, with residual None); residual:
        the stream before it, updated in place. Returns (this layer's MLP output, residual)."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h = self.input_layernorm.add_forward(x, residual)
        h = self.self_attn(h, cos, sin, k_cache, v_cache, meta, backend)
        h = self.post_attention_layernorm.add_forward(h, residual)
        return self.mlp(h), residual
