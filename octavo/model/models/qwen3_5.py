"""Qwen3.5 (text: `qwen3_5_text`), in transformers' op order (Qwen3_5ForCausalLM): three Gated
DeltaNet layers (linear attention with a fixed-size recurrent state) to each full-attention
layer, as `layer_types` says.

- Gated DeltaNet: q, k, v from one projection through a short causal convolution (SiLU), a
  gate z, beta = sigmoid(b) and the decay g = -exp(A_log) * softplus(a + dt_bias); the gated
  delta rule (layers/recurrent/gated_delta.py) over value heads (q and k repeated to them);
  a gated RMSNorm (norm, then times SiLU(z)) and the output projection. Its state (the
  convolution window and the [heads, d_k, d_v] recurrent state) lives in the sequence's state
  slot (layers/recurrent/state.py), which the KV manager pages (paging/state_slots.py).
- Full attention: q and an output gate from one projection (per head: query, then gate),
  RMSNorm on q and k per head, RoPE on the first `partial_rotary_factor` of each head, and the
  output times sigmoid(gate).
- RMSNorm scaled by (1 + weight), in float32 (the norms start at zero).

Text positions only: the multimodal RoPE sections coincide for text, so it is plain RoPE.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from octavo.config import ModelConfig
from octavo.model.layers.attention.base import AttentionBackend, AttentionMetadata
from octavo.model.layers.decoder import MLP, RotaryEmbedding, apply_rope
from octavo.model.layers.kv_cache import KVCache
from octavo.model.layers.kv_quant import KVQuant
from octavo.model.layers.linear import PackedLinear
from octavo.model.layers.recurrent.conv import conv_chunk, conv_decode
from octavo.model.layers.recurrent.gated_delta import chunk_gated_delta, gated_delta_decode
from octavo.model.layers.recurrent.state import StateMetadata, StateShapes
from octavo.model.layers.weights import Value, cat
from octavo.model.models.checkpoint import CheckpointLoader
from octavo.model.models.gemma import GemmaRMSNorm
from octavo.model.models.llama import LlamaForCausalLM

# Qwen3.5's norms are Gemma's: x * rsqrt(mean(x^2) + eps) * (1 + w), all in float32
ZeroCenteredRMSNorm = GemmaRMSNorm


class GatedRMSNorm(nn.Module):
    """transformers' Qwen3_5RMSNormGated: the norm in float32, weight times it in the input
    dtype, then times SiLU(gate) in float32."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        h = self.weight * h.to(dtype)
        return (h * F.silu(gate.float())).to(dtype)


class GatedDeltaNet(nn.Module):
    def __init__(self, config: ModelConfig, index: int) -> None:
        super().__init__()
        hf = config.hf
        self.index = index  # among the recurrent layers: its state tensors
        self.num_k_heads = int(hf["linear_num_key_heads"])
        self.num_v_heads = int(hf["linear_num_value_heads"])
        self.head_k_dim = int(hf["linear_key_head_dim"])
        self.head_v_dim = int(hf["linear_value_head_dim"])
        if self.num_v_heads % self.num_k_heads:
            raise ValueError(f"{config.model_type}: linear_num_value_heads "
                             f"{self.num_v_heads} is not a multiple of linear_num_key_heads "
                             f"{self.num_k_heads}")
        self.key_dim = self.num_k_heads * self.head_k_dim
        self.value_dim = self.num_v_heads * self.head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.kernel = int(hf.get("linear_conv_kernel_dim", 4))
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"{config.model_type}: hidden_act {act!r} is not supported (silu)")
        # in_proj_qkv, in_proj_z, in_proj_b, in_proj_a fused
        self.in_proj = nn.Linear(config.hidden_size,
                                 self.conv_dim + self.value_dim + 2 * self.num_v_heads,
                                 bias=False)
        self.conv_weight = nn.Parameter(torch.empty(self.conv_dim, self.kernel))
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads))
        self.norm = GatedRMSNorm(self.head_v_dim, config.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, config.hidden_size, bias=False)
        self.ops: Any = None  # the compiled CPU ops: the decode step in C++

    def state_shapes(self, dtype: torch.dtype) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """The convolution window and the recurrent state, per sequence."""
        return [((self.conv_dim, self.kernel - 1), dtype),
                ((self.num_v_heads, self.head_k_dim, self.head_v_dim), torch.float32)]

    def _heads(self, mixed: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """[T, conv_dim] -> q, k [T, value heads, dk] (repeated), v [T, value heads, dv]."""
        q, k, v = mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = q.reshape(-1, self.num_k_heads, self.head_k_dim)
        k = k.reshape(-1, self.num_k_heads, self.head_k_dim)
        v = v.reshape(-1, self.num_v_heads, self.head_v_dim)
        if self.num_v_heads != self.num_k_heads:
            rep = self.num_v_heads // self.num_k_heads
            q, k = q.repeat_interleave(rep, dim=1), k.repeat_interleave(rep, dim=1)
        return q, k, v

    def forward(self, x: torch.Tensor, states: list[torch.Tensor],
                meta: StateMetadata) -> torch.Tensor:
        conv_states, rec_states = states
        proj = self.in_proj(x)
        mixed, z, b, a = proj.split([self.conv_dim, self.value_dim, self.num_v_heads,
                                     self.num_v_heads], dim=-1)
        beta = b.sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        core = torch.empty(x.shape[0], self.num_v_heads, self.head_v_dim, dtype=x.dtype,
                           device=x.device)
        nd = meta.num_decodes
        if nd:
            slots = meta.decode_slots
            for slot in meta.fresh_slots:
                conv_states[slot].zero_()
                rec_states[slot].zero_()
            conv_out, windows = conv_decode(mixed[:nd], conv_states[slots], self.conv_weight,
                                            None, F.silu)
            conv_states[slots] = windows.to(conv_states.dtype)
            q, k, v = self._heads(conv_out)
            core[:nd] = gated_delta_decode(q, k, v, g[:nd], beta[:nd], rec_states, slots,
                                           self.ops)
        for c in meta.prefills:
            s, e, slot = c.query_start, c.query_end, c.slot
            fresh = c.start_pos == 0
            conv_out, full = conv_chunk(mixed[s:e], None if fresh else conv_states[slot],
                                        self.conv_weight, None, F.silu)
            q, k, v = self._heads(conv_out)
            init = None if fresh else rec_states[slot]
            out, final = chunk_gated_delta(q, k, v, g[s:e], beta[s:e], init)
            if c.snapshot is not None:
                n, snap = c.snapshot
                conv_states[snap] = full[:, n : n + self.kernel - 1]
                _, rec_states[snap] = chunk_gated_delta(q[:n], k[:n], v[:n], g[s : s + n],
                                                        beta[s : s + n], init)
            conv_states[slot] = full[:, full.shape[1] - (self.kernel - 1):]
            rec_states[slot] = final
            core[s:e] = out
        gated = self.norm(core.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim))
        return self.out_proj(gated.reshape(x.shape[0], self.value_dim))


class GatedAttention(nn.Module):
    """Full attention with an output gate: q_proj gives each head's query and gate side by
    side; q and k normed per head; partial RoPE."""

    def __init__(self, config: ModelConfig, rotary_dim: int) -> None:
        super().__init__()
        # quantized KV pages (kv_quant.py), set by the runner with the cache; None: model dtype
        self.kv_quant: KVQuant | None = None
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim = hd = config.head_dim
        self.q_size, self.kv_size = self.num_heads * hd, self.num_kv_heads * hd
        self.rotary_dim = rotary_dim
        bias = config.attention_bias
        self.qkv_proj = nn.Linear(config.hidden_size, 2 * self.q_size + 2 * self.kv_size,
                                  bias=bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=bias)
        self.q_norm = ZeroCenteredRMSNorm(hd, config.rms_norm_eps)
        self.k_norm = ZeroCenteredRMSNorm(hd, config.rms_norm_eps)
        self.scale = hd**-0.5

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        r = self.rotary_dim
        if r == self.head_dim:
            return apply_rope(x, cos, sin)
        return torch.cat([apply_rope(x[..., :r], cos, sin), x[..., r:]], dim=-1)

    def forward(self, x, cos, sin, k_cache, v_cache, meta, backend: AttentionBackend):
        qkv = self.qkv_proj(x)
        qg, k, v = qkv.split([2 * self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, gate = qg.reshape(-1, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        q = self._rope(self.q_norm(q), cos, sin)
        k = self._rope(self.k_norm(k.reshape(-1, self.num_kv_heads, self.head_dim)), cos, sin)
        v = v.reshape(-1, self.num_kv_heads, self.head_dim)
        o = backend.forward(q, k, v, k_cache, v_cache, meta, self.scale, kv=self.kv_quant)
        o = o.reshape(-1, self.q_size) * torch.sigmoid(gate.reshape(-1, self.q_size))
        return self.o_proj(o)


class Qwen35DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, mixer: nn.Module) -> None:
        super().__init__()
        self.input_layernorm = ZeroCenteredRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mixer = mixer
        self.post_attention_layernorm = ZeroCenteredRMSNorm(config.hidden_size,
                                                            config.rms_norm_eps)
        self.mlp = MLP(config)


class Qwen35ForCausalLM(LlamaForCausalLM):
    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        nn.Module.__init__(self)
        hf = config.hf
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"{config.model_type}: hidden_act {hf.get('hidden_act')!r} is not "
                             "supported (silu)")
        self.config = config
        self.max_positions = max_positions
        self.kinds = list(config.layer_kinds or ("attention",) * config.num_layers)
        rope = hf.get("rope_parameters") or {}
        partial = float(rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)))
        self.rotary_dim = int(config.head_dim * partial)
        groups = config.kv_groups
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            Qwen35DecoderLayer(config, GatedDeltaNet(config, groups.layer_slot[i])
                               if kind == "recurrent" else GatedAttention(config, self.rotary_dim))
            for i, kind in enumerate(self.kinds))
        self.norm = ZeroCenteredRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(config, max_positions)  # the loader's; unused here
        self._tables: dict[torch.device, RotaryEmbedding] = {}  # the partial rotary, fp32

    def _rotary(self, device: torch.device) -> RotaryEmbedding:
        rotary = self._tables.get(device)
        if rotary is None:
            config = dataclasses.replace(self.config, head_dim=self.rotary_dim)
            with torch.device("cpu"):
                rotary = RotaryEmbedding(config, self.max_positions)
            rotary = rotary.to(device=device, dtype=torch.float32)
            self._tables[device] = rotary
        return rotary

    def state_shapes(self, dtype: torch.dtype) -> StateShapes:
        return [layer.mixer.state_shapes(dtype) for layer in self.layers
                if isinstance(layer.mixer, GatedDeltaNet)]

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
        cos, sin = self._rotary(positions.device)(positions, x.dtype)
        groups = kv_cache.groups
        for i, layer in enumerate(self.layers[:num_layers]):
            h = layer.input_layernorm(x)
            meta: Any = metas[groups.layer_group[i]]
            if isinstance(layer.mixer, GatedDeltaNet):
                h = layer.mixer(h, kv_cache.state.layer(layer.mixer.index), meta)
            else:
                k_cache, v_cache = kv_cache.layer(i)
                h = layer.mixer(h, cos, sin, k_cache, v_cache, meta, backend)
            x = x + h
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.lm_head(self.norm(x[logit_indices])).float()

    def use_cpu_ops(self, ops: Any, packed_gemv_rows: int | None = None) -> None:
        """The MLPs' SiLU-and-mul, the Gated DeltaNet decode step and the packed linears'
        GEMV; the norms are zero-centred, not Llama's, and stay in torch."""
        for module in self.modules():
            if isinstance(module, (MLP, GatedDeltaNet)):
                module.ops = ops
            elif isinstance(module, PackedLinear):
                module.use_gemv(ops, packed_gemv_rows)

    def _load_ffn(self, ckpt: CheckpointLoader, src: str, dst: str) -> None:
        """A dense MLP, gate and up fused."""
        ckpt.put(f"{dst}gate_up_proj.weight", cat(
            [ckpt.take(f"{src}{p}_proj.weight") for p in ("gate", "up")]))
        ckpt.copy(f"{src}down_proj.weight", f"{dst}down_proj.weight")

    def _in_proj(self, ckpt: CheckpointLoader, src: str, mixer: GatedDeltaNet) -> Value:
        """The Gated DeltaNet's fused input projection: rows q, k, v, z, b, a."""
        return cat([ckpt.take(f"{src}in_proj_{p}.weight") for p in ("qkv", "z", "b", "a")])

    def load_hf_state_dict(self, tensors: Mapping[str, Value]) -> None:
        ckpt = CheckpointLoader(self, tensors)
        ckpt.copy("model.embed_tokens.weight", "embed_tokens.weight")
        ckpt.copy("model.norm.weight", "norm.weight")
        head = tensors.get("lm_head.weight")
        if head is None or self.config.tie_word_embeddings:
            head = ckpt.take("model.embed_tokens.weight")
        ckpt.put("lm_head.weight", head)
        for i, layer in enumerate(self.layers):
            src, dst = f"model.layers.{i}.", f"layers.{i}."
            for norm in ("input_layernorm", "post_attention_layernorm"):
                ckpt.copy(f"{src}{norm}.weight", f"{dst}{norm}.weight")
            self._load_ffn(ckpt, f"{src}mlp.", f"{dst}mlp.")
            if isinstance(layer.mixer, GatedDeltaNet):
                s, d = src + "linear_attn.", dst + "mixer."
                ckpt.put(f"{d}in_proj.weight", self._in_proj(ckpt, s, layer.mixer))
                ckpt.put(f"{d}conv_weight", ckpt.tensor(f"{s}conv1d.weight").squeeze(1))
                for name in ("dt_bias", "A_log"):
                    ckpt.copy(f"{s}{name}", f"{d}{name}")
                for name in ("norm.weight", "out_proj.weight"):
                    ckpt.copy(f"{s}{name}", f"{d}{name}")
            else:
                s, d = src + "self_attn.", dst + "mixer."
                kinds = ("weight", "bias") if self.config.attention_bias else ("weight",)
                for kind in kinds:
                    ckpt.put(f"{d}qkv_proj.{kind}", cat(
                        [ckpt.take(f"{s}{p}_proj.{kind}") for p in ("q", "k", "v")]))
                    ckpt.copy(f"{s}o_proj.{kind}", f"{d}o_proj.{kind}")
                for norm in ("q_norm", "k_norm"):
                    ckpt.copy(f"{s}{norm}.weight", f"{d}{norm}.weight")
        ckpt.finish()
