"""Qwen3: Llama's shape with an RMSNorm over each head of q and k before RoPE (q_norm, k_norm)
and no qkv bias."""

from __future__ import annotations

from octavo.model.layers.weights import Put, Take
from octavo.model.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True

    def _load_attention(self, src: str, dst: str, take: Take, put: Put) -> None:
        super()._load_attention(src, dst, take, put)
        put(f"{dst}q_norm.weight", take(f"{src}q_norm.weight"))
        put(f"{dst}k_norm.weight", take(f"{src}k_norm.weight"))
