"""Llama (and the families shaped like it: Mistral, Qwen2, Qwen3, Phi-3): token embeddings,
pre-norm decoder layers (layers.py), a final RMSNorm and the LM head, tied or not.

The forward pass takes one flat batch of new tokens (no padding) and returns logits only for
the rows asked for (the last token of each sampling sequence), never for every prompt
position. Loading maps an HF checkpoint's tensors onto the fused layers; a family whose
checkpoint differs overrides one of the `_load_*` steps (phi3.py, qwen3.py).
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

import torch
from torch import nn

from octavo.config import ModelConfig
from octavo.model.layers.attention.base import (
    AttentionBackend,
    AttentionMetadata,
    decode_step_args,
)
from octavo.model.layers.decoder import MLP, Attention, DecoderLayer, RMSNorm, RotaryEmbedding
from octavo.model.layers.kv_cache import KVCache
from octavo.model.layers.linear import PackedLinear
from octavo.model.layers.weights import Checkpoint, Put, Take, Value, cat, copy_into


class LlamaForCausalLM(nn.Module):
    qk_norm = False  # Qwen3 sets it
    # tensor parallelism: cuts this rank's slice from each full checkpoint tensor as it loads
    # (tensor_parallel.ShardPlan.shard); None: the whole model
    shard: Callable[[str, Value], Value] | None = None
    # what quantization=... did at load (quantization.QuantReport), None: full precision
    quant_report: Any = None
    # the C++ loop over the layers for all-decode steps (decode_stack.py), None: Python only
    decode_stack: Any = None

    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, qk_norm=self.qk_norm)
                                    for _ in range(config.num_layers))
        for layer, window in zip(self.layers, config.layer_windows, strict=False):
            layer.self_attn.window = window  # Mistral, Qwen2 and the like: sliding layers
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(config, max_positions)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_cache: KVCache,
        metas: list[AttentionMetadata],  # one per KV cache group
        backend: AttentionBackend,
        logit_indices: torch.Tensor,  # [S] rows whose logits are wanted
        num_layers: int | None = None,  # only the first layers (self-drafting); None: all
    ) -> torch.Tensor:  # [S, vocab] float32
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary(positions, x.dtype, fp32_rows=self.norm.ops is not None)
        residual = None
        args = self.decode_stack_args(metas, x.shape[0], num_layers)
        if args is not None:  # every layer in the C++ loop
            x, residual = self.decode_stack.forward(x, [cos], [sin], kv_cache.device_cache,
                                                    *args)
            num_layers = 0
        group = kv_cache.groups.layer_group
        for i, layer in enumerate(self.layers[:num_layers]):
            k_cache, v_cache = kv_cache.layer(i)
            x, residual = layer(x, residual, cos, sin, k_cache, v_cache, metas[group[i]],
                                backend)
        h = residual[logit_indices] + x[logit_indices] if residual is not None else x[logit_indices]
        return self.lm_head(self.norm(h)).float()

    def decode_stack_args(self, metas: list[AttentionMetadata], rows: int,
                          num_layers: int | None) -> tuple | None:
        """The C++ decode loop's per-group arguments when it runs this step (every layer, every
        row a single-token decode, no more rows than it takes), else None."""
        if (self.decode_stack is None or num_layers is not None
                or rows > self.decode_stack.max_rows()):
            return None
        return decode_step_args(metas, rows)

    def use_cpu_ops(self, ops: Any, packed_gemv_rows: int | None = None) -> None:
        """Route RMSNorm, RoPE and SiLU-and-mul through the compiled CPU ops (None: torch),
        and decode-sized batches of oneDNN-packed linear layers through their packed_gemv
        (of at most `packed_gemv_rows` rows, 0: never; None: the kernel's limit)."""
        for module in self.modules():
            if isinstance(module, (RMSNorm, Attention, MLP)):
                module.ops = ops
            elif isinstance(module, PackedLinear):
                module.use_gemv(ops, packed_gemv_rows)

    def load_hf_state_dict(self, tensors: Checkpoint, skip: Collection[str] = (),
                           sources: dict[str, list[str]] | None = None) -> None:
        """Load an HF Llama checkpoint's tensors (plain, or lazy ones read as they are put:
        layers/weights.py), fusing q/k/v and gate/up. `skip`: parameters left alone (the
        loader puts other layers in their place); `sources`, when given, gets each parameter's
        checkpoint names, in the order they were read (the GGUF loader traces the loading this
        way, on the meta device)."""
        own = dict(self.named_parameters())
        loaded: set[str] = set()
        taken: list[str] = []

        def put(name: str, value: Value) -> None:
            if sources is not None:
                sources[name] = list(dict.fromkeys(taken))
            taken.clear()
            if name in skip:
                loaded.add(name)
                return
            if name not in own:
                raise ValueError(f"checkpoint tensor maps to unknown parameter {name!r}")
            if self.shard is not None:
                value = self.shard(name, value)
            param = own[name]
            if param.shape != value.shape:
                raise ValueError(
                    f"checkpoint tensor for {name!r} has shape {tuple(value.shape)}, "
                    f"expected {tuple(param.shape)}"
                )
            with torch.no_grad():
                copy_into(param, value)
            loaded.add(name)

        def take(name: str) -> Value:
            if name not in tensors:
                raise ValueError(f"checkpoint is missing tensor {name!r}")
            taken.append(name)
            return tensors[name]

        put("embed_tokens.weight", take("model.embed_tokens.weight"))
        put("norm.weight", take("model.norm.weight"))
        tied = self.config.tie_word_embeddings or "lm_head.weight" not in tensors
        if "lm_head.weight" in skip:  # a tied head's tensor is the embedding's: not read again
            put("lm_head.weight", torch.empty(0, device="meta"))
        else:
            put("lm_head.weight", take("model.embed_tokens.weight" if tied else "lm_head.weight"))
        for i in range(self.config.num_layers):
            src, dst = f"model.layers.{i}.", f"layers.{i}."
            for norm in ("input_layernorm", "post_attention_layernorm"):
                put(f"{dst}{norm}.weight", take(f"{src}{norm}.weight"))
            self._load_attention(src + "self_attn.", dst + "self_attn.", take, put)
            self._load_mlp(src + "mlp.", dst + "mlp.", take, put)
        missing = set(own) - loaded
        if missing:
            raise ValueError(f"checkpoint left parameters unset: {sorted(missing)[:5]}")

    def _load_attention(self, src: str, dst: str, take: Take, put: Put) -> None:
        """q, k and v (and their biases) fused into qkv_proj; o_proj."""
        for kind in ("weight", "bias"):
            if kind == "weight" or self.config.attention_bias:
                qkv = [take(f"{src}{p}_proj.{kind}") for p in ("q", "k", "v")]
                put(f"{dst}qkv_proj.{kind}", cat(qkv))
            if kind == "weight" or self.config.o_proj_bias:
                put(f"{dst}o_proj.{kind}", take(f"{src}o_proj.{kind}"))

    def _load_mlp(self, src: str, dst: str, take: Take, put: Put) -> None:
        """gate and up fused into gate_up_proj; down_proj."""
        for kind in ("weight", "bias"):
            if kind == "bias" and not self.config.mlp_bias:
                continue
            gate_up = [take(f"{src}{p}_proj.{kind}") for p in ("gate", "up")]
            put(f"{dst}gate_up_proj.{kind}", cat(gate_up))
            put(f"{dst}down_proj.{kind}", take(f"{src}down_proj.{kind}"))
