"""Qwen3.5 (text), as a tiny random-weight HF model built here, gives HF transformers' greedy
tokens in fp32: under every engine configuration of test_families.py (batched and alone, block
sizes 1 / 16 / 256, prefix caching on and off with state-snapshot hits, preemption with chunked
prefill) and under swap preemption, with a state pool smaller than the batch, with n = 4 and
beam search. Three Gated DeltaNet layers to one full-attention layer, two of each."""

from __future__ import annotations

import pytest
import torch

from octavo import LLM
from octavo.config import ModelConfig
from tests.model.models.hybrid_checks import (
    HYBRID_CONFIGS,
    KV_BYTES,
    check_hybrid,
    check_n4_and_beams,
)
from tests.model.models.test_families import CONFIGS, build_model, check_greedy, hf_greedy, prompts

QWEN3_5 = ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM",
           dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=8,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                linear_value_head_dim=16, linear_conv_kernel_dim=4,
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
    path = build_model(tmp_path_factory.mktemp("qwen3_5"), QWEN3_5, {}, seed=7, perturb=perturb)
    ps = prompts()
    return "qwen3_5_text", path, ps, hf_greedy(path, ps)


@pytest.mark.parametrize("config", list(CONFIGS))
def test_greedy_equals_transformers(family, config) -> None:
    llm = check_greedy(*family, config, kv_cache_memory_bytes=KV_BYTES)
    stats = llm.stats()
    assert stats["state_slots_used"] == 0 and stats["state_bytes_per_slot"] > 0
    if config == "batched-bs16-cache":  # check_greedy's second, cached run restored states
        assert stats["state_snapshot_hits"] > 0, "the cached run restored no state"
        assert stats["state_snapshots_saved"] > 0


@pytest.mark.parametrize("config", list(HYBRID_CONFIGS))
def test_hybrid_configs_equal_transformers(family, config) -> None:
    check_hybrid(*family, config)


def test_n4_and_beam_search(family) -> None:
    check_n4_and_beams(family[1], family[2][5])


def test_layers_and_state(family) -> None:
    config = ModelConfig.from_dir(family[1])
    groups = config.kv_groups
    assert config.layer_kinds == ("recurrent",) * 3 + ("attention",) + ("recurrent",) * 3 + (
        "attention",)
    assert groups.num_state_layers == 6 and groups.num_kv_layers == 2
    assert config.kv_bytes_per_token(4) == 2 * 2 * 2 * 16 * 4


def test_what_holds_no_state_is_refused(family, tmp_path) -> None:
    with pytest.raises(ValueError, match="speculative decoding does not run with"):
        LLM(model=str(family[1]),
            speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="holds no state snapshots"):
        LLM(model=str(family[1]), kv_offload_dir=str(tmp_path))
    with pytest.raises(ValueError, match="holds no recurrent state"):
        LLM(model=str(family[1]), kv_allocator="contiguous")


def test_int8_kv_pages_beside_recurrent_state(family) -> None:
    """The attention layers' pages in int8 (scales in the pages): the same tokens batched and
    one at a time, under prefix caching, and a quarter of fp32's bytes plus the scales; fp8,
    whose scales are per layer, is refused by name for a model with recurrent layers."""
    from tests.model.models.hybrid_checks import KV_BYTES
    from tests.model.models.test_families import GREEDY

    _, path, ps, _ = family
    llm = LLM(model=str(path), kv_cache_dtype="int8", kv_cache_memory_bytes=KV_BYTES,
              block_size=16, enable_prefix_caching=True)
    batched = llm.generate([{"prompt_token_ids": p} for p in ps], GREEDY, use_tqdm=False)
    alone = [llm.generate([{"prompt_token_ids": p}], GREEDY, use_tqdm=False)[0] for p in ps]
    assert [o.outputs[0].token_ids for o in batched] == [o.outputs[0].token_ids for o in alone]
    stats = llm.stats()
    assert stats["kv_cache_dtype"] == "int8"
    assert stats["kv_bytes_per_token"] == 2 * 2 * 2 * (16 + 4)  # two layers own pages
    assert stats["kv_blocks_used"] == 0 and stats.get("state_slots_used", 0) == 0
    with pytest.raises(ValueError, match="fp8 pages need a scale per layer"):
        LLM(model=str(path), kv_cache_dtype="fp8", kv_cache_memory_bytes=KV_BYTES)
