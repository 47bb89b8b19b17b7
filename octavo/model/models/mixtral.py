"""Mixtral: Mistral's attention with a sparse MoE block (moe.py) in every layer: softmax top-k
routing, always renormalised over the k, no shared expert. The checkpoint names the block
`block_sparse_moe` and each expert's gate / down / up projections w1 / w2 / w3."""

from __future__ import annotations

from typing import Any

from octavo.config import ModelConfig
from octavo.model.layers.moe import SparseMoeBlock, has_tensor, load_experts, set_moe_ops
from octavo.model.layers.weights import Put, Take
from octavo.model.models.llama import LlamaForCausalLM


class MixtralForCausalLM(LlamaForCausalLM):
    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        super().__init__(config, max_positions)
        hf = config.hf
        self.num_experts = int(hf["num_local_experts"])
        for layer in self.layers:
            layer.mlp = SparseMoeBlock(
                config, num_experts=self.num_experts, top_k=int(hf["num_experts_per_tok"]),
                intermediate=config.intermediate_size, norm_topk_prob=True,
                weights_in_model_dtype=False)

    def use_cpu_ops(self, ops: Any, packed_gemv_rows: int | None = None) -> None:
        super().use_cpu_ops(ops, packed_gemv_rows)
        set_moe_ops(self, ops)

    def _load_mlp(self, src: str, dst: str, take: Take, put: Put) -> None:
        # HF checkpoints: block_sparse_moe.*; transformers' own layout: mlp.*
        moe_src = src.removesuffix("mlp.") + "block_sparse_moe."
        if has_tensor(take, f"{moe_src}gate.weight"):
            src = moe_src
        put(f"{dst}gate.weight", take(f"{src}gate.weight"))
        load_experts(src, dst, take, put, self.num_experts, ("w1", "w3", "w2"))
