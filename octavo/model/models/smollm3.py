"""SmolLM3: Llama's layers, with no rotary embedding on every fourth layer (`no_rope_layers`:
1 where a layer rotates, 0 where it does not; transformers' SmolLM3Attention). A sliding window,
where the config turns one on, applies to those NoPE layers only (config.py reads it)."""

from __future__ import annotations

from octavo.config import ModelConfig
from octavo.model.models.llama import LlamaForCausalLM


def rope_layers(config: ModelConfig) -> list[bool]:
    """Per layer: whether it rotates q and k."""
    n = config.num_layers
    flags = config.hf.get("no_rope_layers")
    if flags is None:
        interval = int(config.hf.get("no_rope_layer_interval", 4))
        flags = [int((i + 1) % interval != 0) for i in range(n)]
    if len(flags) < n:
        raise ValueError(f"smollm3: no_rope_layers names {len(flags)} layers, the model has {n}")
    return [bool(f) for f in flags[:n]]


class SmolLM3ForCausalLM(LlamaForCausalLM):
    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        super().__init__(config, max_positions)
        for layer, rope in zip(self.layers, rope_layers(config), strict=True):
            layer.self_attn.rope = rope
