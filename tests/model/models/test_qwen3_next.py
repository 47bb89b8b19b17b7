"""Qwen3-Next, as a tiny random-weight HF model built here, gives HF transformers' greedy tokens
in fp32: batched with prefix caching (state-snapshot hits), under preemption with chunked prefill
and under swap. Its layers are Qwen3.5's, which test_qwen3_5.py runs through every other
configuration; what is new here is the checkpoint's interleaved Gated DeltaNet projections,
which the loader takes apart, and the sparse MoE MLPs (a dense one on layer 1)."""

from __future__ import annotations

import pytest
import torch

from octavo.config import ModelConfig
from tests.model.models.hybrid_checks import KV_BYTES, check_hybrid
from tests.model.models.test_families import build_model, check_greedy, hf_greedy, prompts

QWEN3_NEXT = ("Qwen3NextConfig", "Qwen3NextForCausalLM",
              dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                   linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                   linear_value_head_dim=8, linear_conv_kernel_dim=4, num_experts=4,
                   num_experts_per_tok=2, moe_intermediate_size=32,
                   shared_expert_intermediate_size=48, mlp_only_layers=[1],
                   max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False,
                   bos_token_id=1, eos_token_id=2, pad_token_id=0,
                   rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                    "partial_rotary_factor": 0.5}))


def perturb(name: str, p: torch.Tensor) -> None:
    if "norm" in name:  # zero-centred norms start at zero: give them something
        p.add_(torch.randn_like(p) * 0.3)
    elif name.endswith("A_log"):  # slow decays: the state carries far, so it must be right
        p.uniform_(-4.6, -2.3)


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    path = build_model(tmp_path_factory.mktemp("qwen3_next"), QWEN3_NEXT, {}, seed=3,
                       perturb=perturb)
    ps = prompts()
    return "qwen3_next", path, ps, hf_greedy(path, ps)


@pytest.mark.parametrize("config", ["batched-bs16-cache", "preempt-chunked"])
def test_greedy_equals_transformers(family, config) -> None:
    llm = check_greedy(*family, config, kv_cache_memory_bytes=KV_BYTES)
    if config == "batched-bs16-cache":
        assert llm.stats()["state_snapshot_hits"] > 0


def test_swap_equals_transformers(family) -> None:
    check_hybrid(*family, "swap-chunked")


def test_layers(family) -> None:
    config = ModelConfig.from_dir(family[1])
    assert config.layer_kinds == ("recurrent",) * 3 + ("attention",)
