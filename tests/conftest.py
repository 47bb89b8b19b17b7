"""Shared fixtures: a tiny random-weight Llama built in-test, and the embedded default model."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

TINY_CONFIG = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
)


def build_tiny_llama(path: Path, **overrides) -> Path:
    """Save a random-weight HF Llama (seeded) to `path`; no download."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**{**TINY_CONFIG, **overrides})
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    from octavo.model.loader import ensure_default_model

    return ensure_default_model()
