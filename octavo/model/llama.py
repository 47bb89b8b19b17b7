"""octavo's Llama-family model: RMSNorm, RoPE (with rope scaling), SwiGLU MLP, grouped-query
attention over the paged KV cache, tied or untied embeddings.

The forward pass takes one flat batch of new tokens (no padding) and returns logits only for the
rows asked for (the last token of each sampling sequence), never for every prompt position.
Q/K/V and gate/up projections are fused into one matmul each; the weights are concatenated at
load time from the HF checkpoint's separate tensors.

The residual stream is carried beside each layer's output (vLLM's convention), so that every
residual add is fused with the RMSNorm that follows it. On CPU, `use_cpu_ops` switches RMSNorm
(with its residual add), RoPE and SiLU-and-mul to octavo's compiled ops (csrc/fused_ops.cpp),
which follow the same op order; the torch code here is the reference and the fallback.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from octavo.config import ModelConfig
from octavo.model.attention.base import AttentionBackend, AttentionMetadata
from octavo.model.kv_cache import KVCache


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
    raise ValueError(
        f"rope scaling type {rope_type!r} is not supported (supported: default, linear, llama3)"
    )


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position up to max_positions, indexed by each token's position."""

    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        super().__init__()
        inv_freq, attention_scaling = rope_inv_freq(config)
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]
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
    def __init__(self, config: ModelConfig) -> None:
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
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=config.attention_bias)
        self.ops: Any = None  # compiled CPU ops, when enabled

    def forward(self, x, cos, sin, k_cache, v_cache, meta, backend: AttentionBackend):
        qkv = self.qkv_proj(x)
        if self.ops is not None:
            self.ops.rope_(qkv, cos, sin, self.num_heads, self.num_kv_heads, self.head_dim)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        if self.ops is None:
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        o = backend.forward(q, k, v, k_cache, v_cache, meta, self.scale)
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
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
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


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(config, max_positions)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_cache: KVCache,
        meta: AttentionMetadata,
        backend: AttentionBackend,
        logit_indices: torch.Tensor,  # [S] rows whose logits are wanted
    ) -> torch.Tensor:  # [S, vocab] float32
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary(positions, x.dtype, fp32_rows=self.norm.ops is not None)
        residual = None
        for i, layer in enumerate(self.layers):
            k_cache, v_cache = kv_cache.layer(i)
            x, residual = layer(x, residual, cos, sin, k_cache, v_cache, meta, backend)
        h = residual[logit_indices] + x[logit_indices] if residual is not None else x[logit_indices]
        return self.lm_head(self.norm(h)).float()

    def use_cpu_ops(self, ops: Any) -> None:
        """Route RMSNorm, RoPE and SiLU-and-mul through the compiled CPU ops (None: torch)."""
        for module in self.modules():
            if isinstance(module, (RMSNorm, Attention, MLP)):
                module.ops = ops

    def load_hf_state_dict(self, tensors: dict[str, torch.Tensor]) -> None:
        """Load an HF Llama checkpoint's tensors, fusing q/k/v and gate/up."""
        own = dict(self.named_parameters())
        loaded: set[str] = set()

        def put(name: str, value: torch.Tensor) -> None:
            if name not in own:
                raise ValueError(f"checkpoint tensor maps to unknown parameter {name!r}")
            param = own[name]
            if param.shape != value.shape:
                raise ValueError(
                    f"checkpoint tensor for {name!r} has shape {tuple(value.shape)}, "
                    f"expected {tuple(param.shape)}"
                )
            with torch.no_grad():
                param.copy_(value)
            loaded.add(name)

        def take(name: str) -> torch.Tensor:
            if name not in tensors:
                raise ValueError(f"checkpoint is missing tensor {name!r}")
            return tensors[name]

        put("embed_tokens.weight", take("model.embed_tokens.weight"))
        put("norm.weight", take("model.norm.weight"))
        lm_head = tensors.get("lm_head.weight")
        if lm_head is None or self.config.tie_word_embeddings:
            lm_head = take("model.embed_tokens.weight")
        put("lm_head.weight", lm_head)
        for i in range(self.config.num_layers):
            src, dst = f"model.layers.{i}.", f"layers.{i}."
            for norm in ("input_layernorm", "post_attention_layernorm"):
                put(f"{dst}{norm}.weight", take(f"{src}{norm}.weight"))
            a = src + "self_attn."
            for kind in ("weight", "bias"):
                if kind == "bias" and not self.config.attention_bias:
                    continue
                qkv = [take(f"{a}{p}_proj.{kind}") for p in ("q", "k", "v")]
                put(f"{dst}self_attn.qkv_proj.{kind}", torch.cat(qkv, dim=0))
                put(f"{dst}self_attn.o_proj.{kind}", take(f"{a}o_proj.{kind}"))
            m = src + "mlp."
            for kind in ("weight", "bias"):
                if kind == "bias" and not self.config.mlp_bias:
                    continue
                gate_up = [take(f"{m}{p}_proj.{kind}") for p in ("gate", "up")]
                put(f"{dst}mlp.gate_up_proj.{kind}", torch.cat(gate_up, dim=0))
                put(f"{dst}mlp.down_proj.{kind}", take(f"{m}down_proj.{kind}"))
        missing = set(own) - loaded
        if missing:
            raise ValueError(f"checkpoint left parameters unset: {sorted(missing)[:5]}")
