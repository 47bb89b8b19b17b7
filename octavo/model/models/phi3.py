"""Phi-3: Llama's computation, with q/k/v and gate/up already fused in the checkpoint
(`qkv_proj`, `gate_up_proj`, in the order octavo's fused layers use)."""

from __future__ import annotations

from octavo.config import ModelConfig
from octavo.model.layers.weights import Put, Take
from octavo.model.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        factor = config.hf.get("partial_rotary_factor", 1.0)
        if factor != 1.0:
            raise ValueError(f"phi3: partial_rotary_factor={factor} is not supported (only 1.0)")
        super().__init__(config, max_positions)

    def _load_attention(self, src: str, dst: str, take: Take, put: Put) -> None:
        put(f"{dst}qkv_proj.weight", take(f"{src}qkv_proj.weight"))
        put(f"{dst}o_proj.weight", take(f"{src}o_proj.weight"))

    def _load_mlp(self, src: str, dst: str, take: Take, put: Put) -> None:
        put(f"{dst}gate_up_proj.weight", take(f"{src}gate_up_proj.weight"))
        put(f"{dst}down_proj.weight", take(f"{src}down_proj.weight"))
