"""Gemma 4 (text), in transformers' op order (Gemma4ForCausalLM):

- RMSNorm in fp32 as x * (mean(x^2) + eps) ** -0.5, times the weight (not 1 + weight); the
  value norm has no weight;
- q and k normed per head and rotated; attention unscaled (the norms set the scale);
- sliding layers rotate with their own base, global ones with proportional RoPE (the first
  `partial_rotary_factor` of the frequencies); `attention_k_eq_v`: a global layer's values
  are its keys before the key norm;
- per-layer embeddings (PLE): a second embedding of each token, `hidden_size_per_layer_input`
  wide per layer, mixed with a projection of the embeddings; each layer gates it in after the
  MLP; every layer's output is scaled by its `layer_scalar`;
- the last `num_kv_shared_layers` layers compute no K/V: each attends to the K/V of the last
  earlier layer of its type (config.py's kv_sources). That is a paging feature: those layers
  own no pages (KVGroups gives them their source's group and slot), so the KV cache holds K/V
  only for the layers that compute it, and `kv_bytes_per_token` counts only those. A shared
  layer hands the backend its source's new K/V again, which rewrites the same slots with the
  same values, so the backends need no read-only mode. `use_double_wide_mlp` doubles those
  layers' MLP.

Not run (a clear error): MoE blocks (`enable_moe_block`), bidirectional attention, and global
layers whose head size or KV head count differs from the sliding layers' (`per_layer_config`):
the KV cache holds one head shape for all layers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from octavo.config import ModelConfig
from octavo.model.layers.attention.base import AttentionBackend, AttentionMetadata
from octavo.model.layers.decoder import RotaryEmbedding, apply_rope
from octavo.model.layers.kv_cache import KVCache
from octavo.model.layers.kv_quant import KVQuant
from octavo.model.layers.weights import Value, cat
from octavo.model.models.checkpoint import CheckpointLoader
from octavo.model.models.gemma import ACTIVATIONS, GemmaMLP
from octavo.model.models.llama import LlamaForCausalLM

SLIDING, FULL = "sliding_attention", "full_attention"


class Gemma4RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, with_scale: bool = True) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size)) if with_scale else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        # pow(-0.5), not rsqrt: transformers' choice, and the last bit differs
        h = h * torch.pow(h.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)
        if self.weight is not None:
            h = h * self.weight.float()
        return h.type_as(x)


class Gemma4Attention(nn.Module):
    def __init__(self, config: ModelConfig, window: int | None, owns_kv: bool,
                 k_eq_v: bool) -> None:
        super().__init__()
        # quantized KV pages (kv_quant.py), set by the runner with the cache; None: model dtype
        self.kv_quant: KVQuant | None = None
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim = hd = config.head_dim
        self.q_size, self.kv_size = self.num_heads * hd, self.num_kv_heads * hd
        self.window = window
        self.owns_kv, self.k_eq_v = owns_kv, k_eq_v
        kv_out = 0 if not owns_kv else self.kv_size if k_eq_v else 2 * self.kv_size
        bias = config.attention_bias
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + kv_out, bias=bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=bias)
        eps = config.rms_norm_eps
        self.q_norm = Gemma4RMSNorm(hd, eps)
        self.k_norm = Gemma4RMSNorm(hd, eps) if owns_kv else None
        self.v_norm = Gemma4RMSNorm(hd, eps, with_scale=False) if owns_kv else None

    def forward(self, x, cos, sin, k_cache, v_cache, meta, backend: AttentionBackend,
                shared_kv: tuple[torch.Tensor, torch.Tensor] | None):
        """The attention output and the K/V of the new tokens (shared with later layers)."""
        qkv = self.qkv_proj(x)
        q = self.q_norm(qkv[:, : self.q_size].reshape(-1, self.num_heads, self.head_dim))
        q = apply_rope(q, cos, sin)
        if self.owns_kv:
            assert self.k_norm is not None and self.v_norm is not None
            k = qkv[:, self.q_size : self.q_size + self.kv_size]
            v = k if self.k_eq_v else qkv[:, self.q_size + self.kv_size :]
            k = apply_rope(self.k_norm(k.reshape(-1, self.num_kv_heads, self.head_dim)),
                           cos, sin)
            v = self.v_norm(v.reshape(-1, self.num_kv_heads, self.head_dim))
        else:
            assert shared_kv is not None
            k, v = shared_kv
        o = backend.forward(q, k, v, k_cache, v_cache, meta, 1.0, window=self.window,
                            kv=self.kv_quant)
        return self.o_proj(o.reshape(-1, self.q_size)), (k, v)


class Gemma4DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, window: int | None, owns_kv: bool, k_eq_v: bool,
                 double_mlp: bool, per_layer: int) -> None:
        super().__init__()
        eps, hidden = config.rms_norm_eps, config.hidden_size
        self.input_layernorm = Gemma4RMSNorm(hidden, eps)
        self.self_attn = Gemma4Attention(config, window, owns_kv, k_eq_v)
        self.post_attention_layernorm = Gemma4RMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = Gemma4RMSNorm(hidden, eps)
        self.post_feedforward_layernorm = Gemma4RMSNorm(hidden, eps)
        mlp_config = config if not double_mlp else dataclasses.replace(
            config, intermediate_size=2 * config.intermediate_size)
        self.mlp = GemmaMLP(mlp_config)
        self.per_layer = per_layer
        if per_layer:
            self.per_layer_input_gate = nn.Linear(hidden, per_layer, bias=False)
            self.per_layer_projection = nn.Linear(per_layer, hidden, bias=False)
            self.post_per_layer_input_norm = Gemma4RMSNorm(hidden, eps)
        self.layer_scalar = nn.Parameter(torch.ones(1))

    def forward(self, x, per_layer_input, cos, sin, k_cache, v_cache, meta, backend, shared_kv):
        h, kv = self.self_attn(self.input_layernorm(x), cos, sin, k_cache, v_cache, meta,
                               backend, shared_kv)
        x = x + self.post_attention_layernorm(h)
        h = self.mlp(self.pre_feedforward_layernorm(x))
        x = x + self.post_feedforward_layernorm(h)
        if self.per_layer:
            h = self.mlp.act(self.per_layer_input_gate(x)) * per_layer_input
            x = x + self.post_per_layer_input_norm(self.per_layer_projection(h))
        return x * self.layer_scalar, kv


def _check_supported(config: ModelConfig) -> None:
    hf = config.hf
    if hf.get("enable_moe_block"):
        raise ValueError("gemma4_text: MoE blocks (enable_moe_block) are not supported")
    if hf.get("use_bidirectional_attention"):
        raise ValueError("gemma4_text: use_bidirectional_attention is not supported")
    for layer, override in (hf.get("per_layer_config") or {}).items():
        for key, ours in (("head_dim", config.head_dim),
                          ("num_key_value_heads", config.num_kv_heads)):
            if key in override and override[key] != ours:
                raise ValueError(
                    f"gemma4_text: layer {layer} has {key}={override[key]} where the other "
                    f"layers have {ours}; octavo's KV cache holds one head shape for all "
                    "layers")


class Gemma4ForCausalLM(LlamaForCausalLM):
    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        nn.Module.__init__(self)
        _check_supported(config)
        self.config = config
        self.max_positions = max_positions
        hf = config.hf
        n = config.num_layers
        types = hf["layer_types"]
        name = hf.get("hidden_activation") or "gelu_pytorch_tanh"
        if name not in ACTIVATIONS:
            raise ValueError(f"gemma4_text: hidden_activation {name!r} is not supported "
                             f"(supported: {', '.join(ACTIVATIONS)})")
        self.types = list(types)
        self.sources = list(config.kv_sources or range(n))
        softcap = hf.get("final_logit_softcapping")
        self.final_softcap = float(softcap) if softcap else None
        self.per_layer = int(hf.get("hidden_size_per_layer_input") or 0)
        double = bool(hf.get("use_double_wide_mlp"))
        k_eq_v = bool(hf.get("attention_k_eq_v"))
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            Gemma4DecoderLayer(config, config.layer_windows[i], self.sources[i] == i,
                               k_eq_v and types[i] == FULL,
                               double and self.sources[i] != i, self.per_layer)
            for i in range(n))
        if self.per_layer:
            vocab = int(hf.get("vocab_size_per_layer_input") or config.vocab_size)
            self.embed_tokens_per_layer = nn.Embedding(vocab, n * self.per_layer)
            self.per_layer_model_projection = nn.Linear(config.hidden_size, n * self.per_layer,
                                                        bias=False)
            self.per_layer_projection_norm = Gemma4RMSNorm(self.per_layer, config.rms_norm_eps)
        self.norm = Gemma4RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(config, max_positions)  # the loader's; unused here
        # each layer type's cos/sin tables, per device: outside the module tree (fp32, built
        # on first use), like Gemma 3's local tables
        self._tables: dict[tuple[str, torch.device], RotaryEmbedding] = {}

    def _rotary(self, layer_type: str, device: torch.device) -> RotaryEmbedding:
        rotary = self._tables.get((layer_type, device))
        if rotary is None:
            rope = (self.config.hf.get("rope_parameters") or {}).get(layer_type) or {}
            kind = rope.get("rope_type", "default")
            if kind not in ("default", "proportional"):
                raise ValueError(f"gemma4_text: rope_type {kind!r} on {layer_type} layers is "
                                 "not supported (supported: default, proportional)")
            config = dataclasses.replace(
                self.config, rope_theta=float(rope.get("rope_theta", 10000.0)),
                rope_scaling=None if kind == "default" else dict(rope))
            with torch.device("cpu"):
                rotary = RotaryEmbedding(config, self.max_positions)
            rotary = rotary.to(device=device, dtype=torch.float32)
            self._tables[(layer_type, device)] = rotary
        return rotary

    def _per_layer_inputs(self, input_ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """[T, layers, per_layer]: the tokens' own per-layer embeddings mixed with a projection
        of their embeddings (transformers' get_ and project_per_layer_inputs)."""
        n, width = self.config.num_layers, self.per_layer
        own = self.embed_tokens_per_layer(input_ids)
        own = own * torch.tensor(width**0.5).to(own.dtype)
        proj = self.per_layer_model_projection(x) * self.config.hidden_size**-0.5
        proj = self.per_layer_projection_norm(proj.reshape(-1, n, width))
        return (proj + own.reshape(-1, n, width)) * 2.0**-0.5

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
        per_layer = self._per_layer_inputs(input_ids, x) if self.per_layer else None
        tables = {t: self._rotary(t, positions.device)(positions, x.dtype)
                  for t in set(self.types)}
        group = kv_cache.groups.layer_group
        computed: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for i, layer in enumerate(self.layers[:num_layers]):
            k_cache, v_cache = kv_cache.layer(i)
            cos, sin = tables[self.types[i]]
            source = self.sources[i]
            x, kv = layer(x, None if per_layer is None else per_layer[:, i], cos, sin,
                          k_cache, v_cache, metas[group[i]], backend,
                          computed.get(source) if source != i else None)
            if source == i:
                computed[i] = kv
        logits = self.lm_head(self.norm(x[logit_indices]))
        if self.final_softcap is not None:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits.float()

    def use_cpu_ops(self, ops: Any, packed_gemv_rows: int | None = None) -> None:
        """Nothing to switch: the compiled ops are Llama's norm and SiLU."""

    def load_hf_state_dict(self, tensors: Mapping[str, Value]) -> None:
        ckpt = CheckpointLoader(self, tensors)
        ckpt.copy("model.embed_tokens.weight", "embed_tokens.weight")
        ckpt.copy("model.norm.weight", "norm.weight")
        head = tensors.get("lm_head.weight")
        if head is None or self.config.tie_word_embeddings:
            head = ckpt.take("model.embed_tokens.weight")
        ckpt.put("lm_head.weight", head)
        if self.per_layer:
            for name in ("embed_tokens_per_layer.weight", "per_layer_model_projection.weight",
                         "per_layer_projection_norm.weight"):
                ckpt.copy(f"model.{name}", name)
        for i, layer in enumerate(self.layers):
            src, dst = f"model.layers.{i}.", f"layers.{i}."
            names = ["input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm", "self_attn.q_norm", "self_attn.o_proj"]
            attn = layer.self_attn
            if attn.owns_kv:
                names.append("self_attn.k_norm")
            if self.per_layer:
                names += ["per_layer_input_gate", "per_layer_projection",
                          "post_per_layer_input_norm"]
            for name in names:
                ckpt.copy(f"{src}{name}.weight", f"{dst}{name}.weight")
            ckpt.put(f"{dst}layer_scalar", ckpt.take(f"{src}layer_scalar"))
            projs = ["q"] + ([] if not attn.owns_kv else ["k"] if attn.k_eq_v else ["k", "v"])
            kinds = ("weight", "bias") if self.config.attention_bias else ("weight",)
            for kind in kinds:
                ckpt.put(f"{dst}self_attn.qkv_proj.{kind}", cat(
                    [ckpt.take(f"{src}self_attn.{p}_proj.{kind}") for p in projs]))
                if kind == "bias":
                    ckpt.copy(f"{src}self_attn.o_proj.bias", f"{dst}self_attn.o_proj.bias")
            ckpt.put(f"{dst}mlp.gate_up_proj.weight", cat(
                [ckpt.take(f"{src}mlp.{p}_proj.weight") for p in ("gate", "up")]))
            ckpt.copy(f"{src}mlp.down_proj.weight", f"{dst}mlp.down_proj.weight")
        ckpt.finish()
