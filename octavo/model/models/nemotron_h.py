"""Nemotron-H (`nemotron_h`), in transformers' op order (NemotronHForCausalLM): a stack of
blocks, each one RMSNorm and one mixer with a residual around it, the mixer named per layer by
`layers_block_type`: a Mamba-2 layer, attention, or an MLP.

- Mamba-2: one projection gives the gate z, the convolution's input (x, B, C) and dt; a short
  causal convolution with bias (SiLU); the selective scan (layers/recurrent/ssd.py) with
  dt = clamp(softplus(dt + dt_bias)), A = -exp(A_log) and the D skip; an RMSNorm per group of
  SiLU(z) times the scan's output; the output projection. Its state (the convolution window and
  the [heads, head_dim, state_size] scan state) lives in the sequence's state slot
  (layers/recurrent/state.py), which the KV manager pages (paging/state_slots.py).
- Attention: GQA without any position encoding (the Mamba layers carry the order).
- MLP: up, squared ReLU, down (no gate).

The MoE blocks of the larger checkpoints are not run here: a config with them is refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from octavo.config import ModelConfig
from octavo.model.layers.attention.base import AttentionBackend, AttentionMetadata
from octavo.model.layers.decoder import RotaryEmbedding
from octavo.model.layers.kv_cache import KVCache
from octavo.model.layers.kv_quant import KVQuant
from octavo.model.layers.linear import PackedLinear
from octavo.model.layers.recurrent.conv import conv_chunk, conv_decode
from octavo.model.layers.recurrent.ssd import chunk_ssd, ssd_decode
from octavo.model.layers.recurrent.state import StateMetadata, StateShapes
from octavo.model.layers.weights import Value, cat
from octavo.model.models.checkpoint import CheckpointLoader
from octavo.model.models.llama import LlamaForCausalLM


def _json_float(v: Any) -> float:
    """transformers writes infinity into config.json as {"__float__": "Infinity"}."""
    return float(v["__float__"] if isinstance(v, dict) else v)


class RMSNorm(nn.Module):
    """transformers' NemotronHRMSNorm: the weight multiplies in float32, then the cast."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * h).to(x.dtype)


class GroupGatedRMSNorm(nn.Module):
    """transformers' NemotronHRMSNormGated: x * SiLU(gate) in float32, normed per group of
    `group` channels, the weight times it in the input dtype."""

    def __init__(self, size: int, group: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.group, self.eps = group, eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float() * F.silu(gate.float())
        g = h.reshape(*h.shape[:-1], -1, self.group)
        g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * g.reshape(h.shape).to(dtype)


class Mamba2Mixer(nn.Module):
    def __init__(self, config: ModelConfig, index: int) -> None:
        super().__init__()
        hf = config.hf
        self.index = index  # among the recurrent layers: its state tensors
        self.num_heads = int(hf["mamba_num_heads"])
        self.head_dim = int(hf["mamba_head_dim"])
        self.state_size = int(hf["ssm_state_size"])
        self.groups = int(hf.get("n_groups", 1))
        self.kernel = int(hf.get("conv_kernel", 4))
        if self.num_heads % self.groups:
            raise ValueError(f"{config.model_type}: mamba_num_heads {self.num_heads} is not a "
                             f"multiple of n_groups {self.groups}")
        act = hf.get("mamba_hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"{config.model_type}: mamba_hidden_act {act!r} is not supported "
                             "(silu)")
        low, high = hf.get("time_step_limit") or (0.0, float("inf"))
        self.dt_limit = (_json_float(low), _json_float(high))
        self.inner = self.num_heads * self.head_dim
        self.conv_dim = self.inner + 2 * self.groups * self.state_size
        bias = bool(hf.get("use_bias", False))
        self.in_proj = nn.Linear(config.hidden_size, self.inner + self.conv_dim + self.num_heads,
                                 bias=bias)
        self.conv_weight = nn.Parameter(torch.empty(self.conv_dim, self.kernel))
        self.conv_bias = (nn.Parameter(torch.zeros(self.conv_dim))
                          if hf.get("use_conv_bias", True) else None)
        self.dt_bias = nn.Parameter(torch.ones(self.num_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_heads))
        self.D = nn.Parameter(torch.ones(self.num_heads))
        self.norm = GroupGatedRMSNorm(self.inner, self.inner // self.groups, config.rms_norm_eps)
        self.out_proj = nn.Linear(self.inner, config.hidden_size, bias=bias)
        self.ops: Any = None  # the compiled CPU ops: the decode step in C++

    def state_shapes(self, dtype: torch.dtype) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """The convolution window and the scan state, per sequence."""
        return [((self.conv_dim, self.kernel - 1), dtype),
                ((self.num_heads, self.head_dim, self.state_size), torch.float32)]

    def _split(self, xbc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[T, conv_dim] -> x [T, H, P], B, C [T, H, N] (repeated from the groups)."""
        n = self.groups * self.state_size
        x, b, c = xbc.split([self.inner, n, n], dim=-1)
        rep = self.num_heads // self.groups
        b, c = (t.reshape(-1, self.groups, self.state_size).repeat_interleave(rep, dim=1)
                for t in (b, c))
        return x.reshape(-1, self.num_heads, self.head_dim), b, c

    def forward(self, h: torch.Tensor, states: list[torch.Tensor],
                meta: StateMetadata) -> torch.Tensor:
        conv_states, ssm_states = states
        gate, xbc, dt = self.in_proj(h).split([self.inner, self.conv_dim, self.num_heads], dim=-1)
        dt = F.softplus(dt + self.dt_bias).clamp(*self.dt_limit)
        a = -self.A_log.float().exp()
        out = torch.empty(h.shape[0], self.num_heads, self.head_dim, dtype=h.dtype,
                          device=h.device)
        nd = meta.num_decodes
        if nd:
            slots = meta.decode_slots
            for slot in meta.fresh_slots:
                conv_states[slot].zero_()
                ssm_states[slot].zero_()
            conv_out, windows = conv_decode(xbc[:nd], conv_states[slots], self.conv_weight,
                                            self.conv_bias, F.silu)
            conv_states[slots] = windows.to(conv_states.dtype)
            x, b, c = conv_out.split([self.inner, *(2 * [self.groups * self.state_size])], -1)
            b, c = (t.reshape(nd, self.groups, self.state_size) for t in (b, c))
            out[:nd] = ssd_decode(x.reshape(nd, self.num_heads, self.head_dim), dt[:nd], a, b, c,
                                  self.D, ssm_states, slots, self.ops)
        for chunk in meta.prefills:
            s, e, slot = chunk.query_start, chunk.query_end, chunk.slot
            fresh = chunk.start_pos == 0
            conv_out, full = conv_chunk(xbc[s:e], None if fresh else conv_states[slot],
                                        self.conv_weight, self.conv_bias, F.silu)
            x, b, c = self._split(conv_out)
            init = None if fresh else ssm_states[slot]
            y, final = chunk_ssd(x, dt[s:e], a, b, c, self.D, init)
            if chunk.snapshot is not None:
                n, snap = chunk.snapshot
                conv_states[snap] = full[:, n : n + self.kernel - 1]
                _, ssm_states[snap] = chunk_ssd(x[:n], dt[s : s + n], a, b[:n], c[:n], self.D,
                                                init)
            conv_states[slot] = full[:, full.shape[1] - (self.kernel - 1):]
            ssm_states[slot] = final
            out[s:e] = y
        y = self.norm(out.reshape(h.shape[0], self.inner), gate)
        return self.out_proj(y)


class PlainAttention(nn.Module):
    """GQA over the paged cache with no position encoding."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        # quantized KV pages (kv_quant.py), set by the runner with the cache; None: model dtype
        self.kv_quant: KVQuant | None = None
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim = hd = config.head_dim
        self.q_size, self.kv_size = self.num_heads * hd, self.num_kv_heads * hd
        bias = config.attention_bias
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=bias)
        self.scale = hd**-0.5

    def forward(self, x, k_cache, v_cache, meta, backend: AttentionBackend) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        o = backend.forward(q.reshape(-1, self.num_heads, self.head_dim),
                            k.reshape(-1, self.num_kv_heads, self.head_dim),
                            v.reshape(-1, self.num_kv_heads, self.head_dim),
                            k_cache, v_cache, meta, self.scale, kv=self.kv_quant)
        return self.o_proj(o.reshape(-1, self.q_size))


class ReluSquaredMLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        act = config.hf.get("mlp_hidden_act", "relu2")
        if act != "relu2":
            raise ValueError(f"{config.model_type}: mlp_hidden_act {act!r} is not supported "
                             "(relu2)")
        bias = config.mlp_bias
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.relu(self.up_proj(x)).square())


class NemotronHBlock(nn.Module):
    def __init__(self, config: ModelConfig, mixer: nn.Module) -> None:
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mixer = mixer


class NemotronHForCausalLM(LlamaForCausalLM):
    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        nn.Module.__init__(self)
        types = config.hf.get("layers_block_type") or []
        if "moe" in types:
            raise ValueError(f"{config.model_type}: MoE blocks are not supported; octavo runs "
                             "Nemotron-H configs of Mamba-2, attention and MLP blocks")
        self.config = config
        self.max_positions = max_positions
        groups = config.kv_groups
        kinds = config.layer_kinds or ("attention",) * config.num_layers
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            NemotronHBlock(config, Mamba2Mixer(config, groups.layer_slot[i])
                           if kind == "recurrent" else PlainAttention(config)
                           if kind == "attention" else ReluSquaredMLP(config))
            for i, kind in enumerate(kinds))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(config, max_positions)  # the loader's; unused here

    def state_shapes(self, dtype: torch.dtype) -> StateShapes:
        return [layer.mixer.state_shapes(dtype) for layer in self.layers
                if isinstance(layer.mixer, Mamba2Mixer)]

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
        groups = kv_cache.groups
        for i, layer in enumerate(self.layers[:num_layers]):
            h = layer.norm(x)
            mixer = layer.mixer
            if isinstance(mixer, Mamba2Mixer):
                meta: Any = metas[groups.layer_group[i]]
                h = mixer(h, kv_cache.state.layer(mixer.index), meta)
            elif isinstance(mixer, PlainAttention):
                k_cache, v_cache = kv_cache.layer(i)
                h = mixer(h, k_cache, v_cache, metas[groups.layer_group[i]], backend)
            else:
                h = mixer(h)
            x = x + h
        return self.lm_head(self.norm(x[logit_indices])).float()

    def use_cpu_ops(self, ops: Any, packed_gemv_rows: int | None = None) -> None:
        """The Mamba-2 decode step and the packed linears' GEMV; nothing of Llama's fused ops
        applies (no gated MLP, no Llama norms)."""
        for module in self.modules():
            if isinstance(module, Mamba2Mixer):
                module.ops = ops
            elif isinstance(module, PackedLinear):
                module.use_gemv(ops, packed_gemv_rows)

    def load_hf_state_dict(self, tensors: Mapping[str, Value]) -> None:
        ckpt = CheckpointLoader(self, tensors)
        # the checkpoints keep the trunk under `backbone.`; transformers' own module is `model.`
        top = "backbone." if "backbone.embeddings.weight" in tensors else "model."
        ckpt.copy(f"{top}embeddings.weight", "embed_tokens.weight")
        ckpt.copy(f"{top}norm_f.weight", "norm.weight")
        head = tensors.get("lm_head.weight")
        if head is None or self.config.tie_word_embeddings:
            head = ckpt.take(f"{top}embeddings.weight")
        ckpt.put("lm_head.weight", head)
        for i, layer in enumerate(self.layers):
            s, d = f"{top}layers.{i}.", f"layers.{i}."
            ckpt.copy(f"{s}norm.weight", f"{d}norm.weight")
            s, d = s + "mixer.", d + "mixer."
            names = [n for n, _ in layer.mixer.named_parameters()]
            if isinstance(layer.mixer, Mamba2Mixer):
                ckpt.put(f"{d}conv_weight", ckpt.tensor(f"{s}conv1d.weight").squeeze(1))
                if layer.mixer.conv_bias is not None:
                    ckpt.copy(f"{s}conv1d.bias", f"{d}conv_bias")
                names = [n for n in names if not n.startswith("conv_")]
            elif isinstance(layer.mixer, PlainAttention):
                for kind in ("weight", "bias") if self.config.attention_bias else ("weight",):
                    ckpt.put(f"{d}qkv_proj.{kind}", cat(
                        [ckpt.take(f"{s}{p}_proj.{kind}") for p in ("q", "k", "v")]))
                names = [n for n in names if not n.startswith("qkv_proj.")]
            for name in names:
                ckpt.copy(s + name, d + name)
        ckpt.finish()
