"""Gemma 2 and Gemma 3 (text): Llama's skeleton with Gemma's details, in transformers' op order.

- RMSNorm in fp32 scaled by (1 + weight), cast back after the scale (GemmaRMSNorm);
- embeddings times sqrt(hidden_size), that factor cast to the model dtype first;
- four norms per layer: input and post-attention around attention, pre- and post-feedforward
  around the MLP, each branch normed before its residual add;
- a GeGLU MLP (`hidden_activation`, gelu with the tanh approximation);
- attention scaled by query_pre_attn_scalar ** -0.5, and per layer local (sliding window) or
  global attention (`layer_types`, else Gemma 2's alternation / Gemma 3's
  `sliding_window_pattern`);
- Gemma 2: attention-score and final-logit soft caps; Gemma 3: q/k norms, and local layers
  rotate with their own base (`rope_parameters["sliding_attention"]`, or the older
  `rope_local_base_freq`), while global ones take `rope_parameters["full_attention"]` (with
  its scaling), which config.py reads as the model's rope.

Tied embeddings. Of the compiled CPU ops the RMSNorm (with 1 + w as its weight, for fp32
activations) and the RoPE apply; with fp32 activations an all-decode step runs every layer in
the C++ decode loop (decode_stack.py), with the same ops in the same order; attention goes
through the backends, which take `window` and `softcap` per call.
A "gemma3" (multimodal) config is not run: only "gemma3_text".
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from octavo.config import ModelConfig
from octavo.model.layers.attention.base import AttentionBackend, AttentionMetadata
from octavo.model.layers.decoder import MLP, Attention, RMSNorm, RotaryEmbedding
from octavo.model.layers.kv_cache import KVCache
from octavo.model.layers.weights import Put, Take
from octavo.model.models.llama import LlamaForCausalLM

ACTIVATIONS = {
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
}


class GemmaRMSNorm(RMSNorm):
    """transformers' Gemma2/3RMSNorm: x * rsqrt(mean(x^2) + eps) * (1 + w), all in fp32.

    With the compiled CPU ops and fp32 activations it runs the fused `rms_norm` with the weight
    1 + w computed once (`use_fused`): Llama's norm, whose scale is applied in the activations'
    dtype, is then Gemma's, which applies it in fp32. Other dtypes keep the torch ops."""

    scale: torch.Tensor | None = None  # 1 + w in fp32, for the fused op

    def use_fused(self, ops: Any) -> None:
        """Route fp32 rows through `ops.rms_norm` (None: torch); after the weights load."""
        self.ops = ops
        self.scale = None if ops is None else (1.0 + self.weight.detach().float()).contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.scale is not None and x.dtype == torch.float32 and x.dim() == 2:
            return self.ops.rms_norm(x.contiguous(), self.scale, self.eps)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).type_as(x)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """residual += x, then the norm (never Llama's fused add-and-norm, whose weight is w)."""
        residual.add_(x)
        return self.forward(residual)


class GemmaMLP(MLP):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        name = config.hf.get("hidden_activation") or config.hf.get("hidden_act")
        name = name or "gelu_pytorch_tanh"
        if name not in ACTIVATIONS:
            raise ValueError(f"{config.model_type}: hidden_activation {name!r} is not supported "
                             f"(supported: {', '.join(ACTIVATIONS)})")
        self.act = ACTIVATIONS[name]
        # the C++ decode loop's name for it (decode_stack.py)
        self.act_name = "gelu" if name == "gelu" else "gelu_tanh"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.down_proj(self.act(gate) * up)


class GemmaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, qk_norm: bool, window: int | None,
                 softcap: float | None) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.self_attn = Attention(config, qk_norm=qk_norm)
        if qk_norm:
            self.self_attn.q_norm = GemmaRMSNorm(config.head_dim, eps)
            self.self_attn.k_norm = GemmaRMSNorm(config.head_dim, eps)
        self.self_attn.scale = float(config.hf.get("query_pre_attn_scalar",
                                                   config.head_dim)) ** -0.5
        self.self_attn.window = window
        self.self_attn.softcap = softcap
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.mlp = GemmaMLP(config)

    def forward(self, x, cos, sin, k_cache, v_cache, meta, backend):
        h = self.self_attn(self.input_layernorm(x), cos, sin, k_cache, v_cache, meta, backend)
        x = x + self.post_attention_layernorm(h)
        h = self.mlp(self.pre_feedforward_layernorm(x))
        return x + self.post_feedforward_layernorm(h)


class Gemma2ForCausalLM(LlamaForCausalLM):
    qk_norm = False
    local_rope = False  # Gemma 3's local layers rotate with their own base

    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        nn.Module.__init__(self)
        self.config = config
        self.max_positions = max_positions
        if config.hf.get("use_bidirectional_attention"):
            raise ValueError(f"{config.model_type}: use_bidirectional_attention is not supported")
        hf = config.hf
        softcap = hf.get("attn_logit_softcapping")
        final = hf.get("final_logit_softcapping")
        self.final_softcap = float(final) if final else None
        self.local = [window is not None for window in config.layer_windows]
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            GemmaDecoderLayer(config, self.qk_norm, window, float(softcap) if softcap else None)
            for window in config.layer_windows)
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(config, max_positions)  # global layers (the runner's)
        # local layers' tables, per device: plain tensors outside the module tree, built on
        # first use, so that neither meta init nor the model's dtype cast touches them (fp32)
        self._local_tables: dict[torch.device, RotaryEmbedding] = {}

    def _local_rotary(self, device: torch.device) -> RotaryEmbedding:
        rotary = self._local_tables.get(device)
        if rotary is None:
            rope = self.config.hf.get("rope_parameters") or {}
            local = rope.get("sliding_attention") if isinstance(rope, dict) else None
            theta = (local or {}).get("rope_theta",
                                      self.config.hf.get("rope_local_base_freq", 10000.0))
            if (local or {}).get("rope_type", "default") != "default":
                raise ValueError("gemma3: only default rope is supported on local layers")
            config = dataclasses.replace(self.config, rope_theta=float(theta), rope_scaling=None)
            with torch.device("cpu"):
                rotary = RotaryEmbedding(config, self.max_positions)
            rotary = rotary.to(device=device, dtype=torch.float32)
            self._local_tables[device] = rotary
        return rotary

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: KVCache,
        metas: list[AttentionMetadata],
        backend: AttentionBackend,
        logit_indices: torch.Tensor,
        num_layers: int | None = None,
    ) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        x = x * torch.tensor(self.config.hidden_size**0.5).to(x.dtype)
        fp32_rows = self.layers[0].self_attn.ops is not None  # the compiled RoPE's tables
        cos, sin = self.rotary(positions, x.dtype, fp32_rows)
        local_cos, local_sin = cos, sin
        if self.local_rope and any(self.local):
            local_cos, local_sin = self._local_rotary(positions.device)(positions, x.dtype,
                                                                       fp32_rows)
        args = self.decode_stack_args(metas, x.shape[0], num_layers)
        if args is not None:  # every layer in the C++ loop
            (x,) = self.decode_stack.forward(x, [cos, local_cos], [sin, local_sin],
                                             kv_cache.device_cache, *args)
            num_layers = 0
        group = kv_cache.groups.layer_group
        for i, layer in enumerate(self.layers[:num_layers]):
            k_cache, v_cache = kv_cache.layer(i)
            c, s = (local_cos, local_sin) if self.local[i] else (cos, sin)
            x = layer(x, c, s, k_cache, v_cache, metas[group[i]], backend)
        logits = self.lm_head(self.norm(x[logit_indices]))
        if self.final_softcap is not None:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits.float()

    def use_cpu_ops(self, ops: Any, packed_gemv_rows: int | None = None) -> None:
        """Gemma's norms through the compiled `rms_norm` (GemmaRMSNorm.use_fused) and its RoPE
        through the compiled `rope_` (fp32 tables per layer kind); the GELU MLP stays in torch
        (the C++ decode loop calls the same ATen ops)."""
        for module in self.modules():
            if isinstance(module, GemmaRMSNorm):
                module.use_fused(ops)
            elif isinstance(module, Attention):
                module.ops = ops

    def _load_mlp(self, src: str, dst: str, take: Take, put: Put) -> None:
        super()._load_mlp(src, dst, take, put)
        layer_src, layer_dst = src.removesuffix("mlp."), dst.removesuffix("mlp.")
        for norm in ("pre_feedforward_layernorm", "post_feedforward_layernorm"):
            put(f"{layer_dst}{norm}.weight", take(f"{layer_src}{norm}.weight"))


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    qk_norm = True
    local_rope = True

    def _load_attention(self, src: str, dst: str, take: Take, put: Put) -> None:
        super()._load_attention(src, dst, take, put)
        put(f"{dst}q_norm.weight", take(f"{src}q_norm.weight"))
        put(f"{dst}k_norm.weight", take(f"{src}k_norm.weight"))
