"""Configs that are not options: the model's architecture, and what the scheduler is given.

Every option a user can set (and its default) lives in octavo/engine_args.py; config flows one
way: CLI flags / LLM kwargs -> EngineArgs -> these -> the parts. A neutral module.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

LLAMA_FAMILY = {"llama", "mistral", "qwen2"}


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """The architecture of a Llama-family model, read from an HF ``config.json``."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False
    mlp_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        config_file = Path(path) / "config.json"
        if not config_file.is_file():
            raise ValueError(f"model directory {path} has no config.json")
        return cls.from_hf_dict(json.loads(config_file.read_text()))

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> ModelConfig:
        model_type = d.get("model_type")
        if model_type not in LLAMA_FAMILY:
            raise ValueError(
                f"unsupported model_type {model_type!r}: octavo runs Llama-family models "
                f"({', '.join(sorted(LLAMA_FAMILY))})"
            )
        num_heads = d["num_attention_heads"]
        # transformers >= 5 keeps rope settings in `rope_parameters`; older configs use
        # `rope_theta` + `rope_scaling`.
        rope = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
        rope_theta = float(rope.pop("rope_theta", d.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return cls(
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_layers=d["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=d.get("num_key_value_heads") or num_heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // num_heads,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=None if rope_type == "default" else rope,
            max_position_embeddings=d.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bool(d.get("attention_bias", model_type == "qwen2")),
            mlp_bias=bool(d.get("mlp_bias", False)),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """What the scheduler needs; built by EngineArgs.scheduler_config (the defaults live there)."""

    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    preemption_mode: str
    scheduling_policy: str
