"""Qwen3-Next (`qwen3_next`), in transformers' op order (Qwen3NextForCausalLM): Qwen3.5's layers
(qwen3_5.py: Gated DeltaNet and gated full attention as `layer_types` says, zero-centred norms)
with Qwen2-MoE's sparse MLP blocks (layers/moe.py: softmax top-k routing, a shared expert scaled
by sigmoid(shared_expert_gate)); layer i is sparse unless it is in `mlp_only_layers` or (i + 1)
is not a multiple of `decoder_sparse_step`.

The checkpoint's Gated DeltaNet projections interleave their outputs per key head
(in_proj_qkvz: each head's q, k, then its value heads' v and z; in_proj_ba: its value heads' b,
then a); transformers' fix_query_key_value_ordering takes them apart at run time, the loader
here once, into Qwen3.5's rows (all q, all k, all v, all z, all b, all a)."""

from __future__ import annotations

from typing import Any

import torch

from octavo.config import ModelConfig
from octavo.model.layers.moe import SparseMoeBlock, load_experts, set_moe_ops
from octavo.model.layers.weights import Value
from octavo.model.models.checkpoint import CheckpointLoader
from octavo.model.models.qwen2_moe import sparse_layers
from octavo.model.models.qwen3_5 import GatedDeltaNet, Qwen35ForCausalLM


class Qwen3NextForCausalLM(Qwen35ForCausalLM):
    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        super().__init__(config, max_positions)
        hf = config.hf
        self.num_experts = int(hf.get("num_experts", 0) or 0)
        for i in sorted(sparse_layers(config)):
            self.layers[i].mlp = SparseMoeBlock(
                config, num_experts=self.num_experts, top_k=int(hf["num_experts_per_tok"]),
                intermediate=int(hf["moe_intermediate_size"]),
                norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
                weights_in_model_dtype=True,
                shared_intermediate=int(hf["shared_expert_intermediate_size"]))

    def use_cpu_ops(self, ops: Any, packed_gemv_rows: int | None = None) -> None:
        super().use_cpu_ops(ops, packed_gemv_rows)
        set_moe_ops(self, ops)

    def _load_ffn(self, ckpt: CheckpointLoader, src: str, dst: str) -> None:
        if not isinstance(self.get_submodule(dst.rstrip(".")), SparseMoeBlock):
            super()._load_ffn(ckpt, src, dst)
            return
        ckpt.put(f"{dst}gate.weight", ckpt.take(f"{src}gate.weight"))
        load_experts(src, dst, ckpt.take, ckpt.put, self.num_experts,
                     ("gate_proj", "up_proj", "down_proj"))
        super()._load_ffn(ckpt, f"{src}shared_expert.", f"{dst}shared_expert.")
        ckpt.put(f"{dst}shared_expert_gate.weight", ckpt.take(f"{src}shared_expert_gate.weight"))

    def _in_proj(self, ckpt: CheckpointLoader, src: str, mixer: GatedDeltaNet) -> Value:
        heads, dk, dv = mixer.num_k_heads, mixer.head_k_dim, mixer.head_v_dim
        per = mixer.num_v_heads // heads  # value heads per key head
        qkvz = ckpt.tensor(f"{src}in_proj_qkvz.weight")
        ba = ckpt.tensor(f"{src}in_proj_ba.weight")
        hidden = qkvz.shape[-1]
        q, k, v, z = qkvz.reshape(heads, -1, hidden).split([dk, dk, per * dv, per * dv], dim=1)
        b, a = ba.reshape(heads, -1, hidden).split([per, per], dim=1)
        return torch.cat([t.reshape(-1, hidden) for t in (q, k, v, z, b, a)])
