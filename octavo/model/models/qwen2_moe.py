"""Qwen2-MoE: Qwen2's attention (qkv bias, see config.py) with sparse MoE blocks (moe.py):
softmax top-k routing, renormalised when `norm_topk_prob`, plus a shared expert scaled by
sigmoid(shared_expert_gate). Layer i is sparse unless it is in `mlp_only_layers` or
(i + 1) is not a multiple of `decoder_sparse_step`; dense layers use `intermediate_size`."""

from __future__ import annotations

from typing import Any

from octavo.config import ModelConfig
from octavo.model.layers.moe import SparseMoeBlock, load_experts, set_moe_ops
from octavo.model.layers.weights import Put, Take
from octavo.model.models.llama import LlamaForCausalLM


def sparse_layers(config: ModelConfig) -> set[int]:
    hf = config.hf
    step = int(hf.get("decoder_sparse_step", 1) or 1)
    if int(hf.get("num_experts", 0) or 0) <= 0:
        return set()
    dense = set(hf.get("mlp_only_layers") or ())
    return {i for i in range(config.num_layers) if i not in dense and (i + 1) % step == 0}


class Qwen2MoeForCausalLM(LlamaForCausalLM):
    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        super().__init__(config, max_positions)
        hf = config.hf
        self.num_experts = int(hf.get("num_experts", 0) or 0)
        for i in sorted(sparse_layers(config)):
            self.layers[i].mlp = SparseMoeBlock(
                config, num_experts=self.num_experts, top_k=int(hf["num_experts_per_tok"]),
                intermediate=int(hf["moe_intermediate_size"]),
                norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
                weights_in_model_dtype=True,
                shared_intermediate=int(hf["shared_expert_intermediate_size"]))

    def use_cpu_ops(self, ops: Any, packed_gemv_rows: int | None = None) -> None:
        super().use_cpu_ops(ops, packed_gemv_rows)
        set_moe_ops(self, ops)

    def _load_mlp(self, src: str, dst: str, take: Take, put: Put) -> None:
        if not isinstance(self.get_submodule(dst.rstrip(".")), SparseMoeBlock):
            super()._load_mlp(src, dst, take, put)
            return
        put(f"{dst}gate.weight", take(f"{src}gate.weight"))
        load_experts(src, dst, take, put, self.num_experts, ("gate_proj", "up_proj", "down_proj"))
        super()._load_mlp(f"{src}shared_expert.", f"{dst}shared_expert.", take, put)
        put(f"{dst}shared_expert_gate.weight", take(f"{src}shared_expert_gate.weight"))
