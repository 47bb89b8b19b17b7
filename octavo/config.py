"""Small config dataclasses. Config flows one way: CLI/kwargs -> config -> parts."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
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


SUPPORTED_BLOCK_SIZES = (1, 8, 16, 32, 64, 128, 256)
SUPPORTED_DTYPES = ("float32", "bfloat16", "float16")


@dataclass(slots=True)
class CacheConfig:
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_bytes: int | None = None
    enable_prefix_caching: bool = True
    kv_allocator: str = "paged"

    def __post_init__(self) -> None:
        if self.block_size not in SUPPORTED_BLOCK_SIZES:
            raise ValueError(
                f"block_size={self.block_size} is not supported; choose one of "
                f"{SUPPORTED_BLOCK_SIZES}"
            )
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes < 1:
            raise ValueError(
                f"kv_cache_memory_bytes must be >= 1, got {self.kv_cache_memory_bytes}"
            )
        if self.kv_allocator not in ("paged", "contiguous"):
            raise ValueError(
                f"kv_allocator must be 'paged' or 'contiguous', got {self.kv_allocator!r}"
            )


@dataclass(slots=True)
class EngineConfig:
    model: str | None = None
    dtype: str = "float32"
    device: str = "cpu"
    max_model_len: int | None = None
    seed: int = 0
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    preemption_mode: str = "recompute"
    scheduling_policy: str = "fcfs"
    # host (CPU) swap space for preemption_mode="swap", in GiB as vLLM's `swap_space`;
    # None = as many host blocks as device blocks when swapping, else none
    swap_space: float | None = None
    gpu_memory_utilization: float = 0.9
    attention_backend: str = "auto"  # auto | torch | cpu (the compiled CPU decode kernel)
    linear_backend: str = "auto"  # auto | torch | onednn (pre-packed oneDNN weights on CPU)
    fused_ops: str = "auto"  # auto | torch | cpu (compiled RMSNorm/RoPE/SiLU-and-mul on CPU)
    cache: CacheConfig = field(default_factory=CacheConfig)

    def __post_init__(self) -> None:
        if self.dtype not in SUPPORTED_DTYPES:
            raise ValueError(
                f"dtype={self.dtype!r} is not supported; choose one of {SUPPORTED_DTYPES}"
            )
