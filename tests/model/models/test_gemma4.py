"""Gemma 4 (text), as a tiny random-weight HF model built here, gives HF transformers' greedy
tokens in fp32 under every engine configuration of test_families.py, under swap preemption with
chunked prefill, with n = 4 and beam search (forks share the source layers' pages). Six layers,
sliding (window 24) and global in turn; the last two compute no K/V but attend to layers 2 and
3's: they own no KV pages, so the cache holds four layers per token. With per-layer embeddings,
keys as values on the global layers, double-wide MLPs on the shared layers, proportional RoPE
and a final soft cap."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from octavo.config import ModelConfig
from tests.conftest import build_byte_tokenizer
from tests.model.models.hybrid_checks import KV_BYTES, check_hybrid, check_n4_and_beams
from tests.model.models.test_families import CONFIGS, check_greedy, hf_greedy, prompts

GEMMA4 = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_attention_heads=4,
              num_key_value_heads=2, head_dim=32, global_head_dim=32,
              max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=True,
              bos_token_id=1, eos_token_id=2, pad_token_id=0, num_hidden_layers=6,
              sliding_window=24, layer_types=["sliding_attention", "full_attention"] * 3,
              num_kv_shared_layers=2, hidden_size_per_layer_input=8,
              vocab_size_per_layer_input=256, attention_k_eq_v=True, use_double_wide_mlp=True,
              final_logit_softcapping=5.0,
              rope_parameters={
                  "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0},
                  "full_attention": {"rope_type": "proportional", "rope_theta": 100000.0,
                                     "partial_rotary_factor": 0.5}})


def build(path: Path, **overrides) -> Path:
    import transformers

    torch.manual_seed(11)
    config = transformers.Gemma4TextConfig(**{**GEMMA4, **overrides})
    config._attn_implementation = "eager"
    model = transformers.Gemma4ForCausalLM(config).eval()
    with torch.no_grad():  # norms and layer scalars start at one: give them something
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if "norm" in name:
                t.add_(torch.randn_like(t) * 0.3)
            elif name.endswith("layer_scalar"):
                t.uniform_(0.2, 4.0)
    model.save_pretrained(path, safe_serialization=True)
    build_byte_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    path = build(tmp_path_factory.mktemp("gemma4"))
    ps = prompts()
    return "gemma4_text", path, ps, hf_greedy(path, ps, attn_implementation="eager")


@pytest.mark.parametrize("config", list(CONFIGS))
def test_greedy_equals_transformers(family, config) -> None:
    llm = check_greedy(*family, config, kv_cache_memory_bytes=KV_BYTES)
    assert llm.stats()["kv_bytes_per_token"] == 2 * 4 * 2 * 32 * 4  # four layers, fp32


def test_swap_preemption_equals_transformers(family) -> None:
    check_hybrid(*family, "swap-chunked")


def test_n4_and_beam_search(family) -> None:
    check_n4_and_beams(family[1], family[2][5], attn_implementation="eager")


def test_shared_layers_own_no_pages(family) -> None:
    config = ModelConfig.from_dir(family[1])
    assert config.kv_sources == (0, 1, 2, 3, 2, 3)
    groups = config.kv_groups
    assert groups.windows == (24, None) and groups.slots_per_group == 2
    assert groups.num_kv_layers == 4
    assert groups.layer_group[4:] == groups.layer_group[2:4]
    assert groups.layer_slot[4:] == groups.layer_slot[2:4]
    assert config.kv_bytes_per_token(4) == 2 * 4 * 2 * 32 * 4  # four layers' K and V, fp32


def test_unsupported_shapes_are_named(tmp_path) -> None:
    from octavo import LLM

    path = build(tmp_path / "g", global_head_dim=64)
    with pytest.raises(ValueError, match="head_dim=64 where the other layers have 32"):
        LLM(model=str(path))
