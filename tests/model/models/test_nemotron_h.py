"""Nemotron-H (Mamba-2 blocks beside attention and MLP blocks), as a tiny random-weight HF
model built here, gives HF transformers' greedy tokens in fp32: batched and alone, block sizes
1 / 16 / 256, prefix caching on and off with state-snapshot hits, preemption with chunked
prefill (test_families.py's configurations), swap preemption, a state pool smaller than the
batch, n = 4 and beam search."""

from __future__ import annotations

import pytest
import torch

from octavo.config import ModelConfig
from tests.model.models.hybrid_checks import (
    HYBRID_CONFIGS,
    KV_BYTES,
    check_hybrid,
    check_n4_and_beams,
)
from tests.model.models.test_families import CONFIGS, build_model, check_greedy, hf_greedy, prompts

NEMOTRON_H = ("NemotronHConfig", "NemotronHForCausalLM",
              dict(vocab_size=256, hidden_size=64, intermediate_size=128,
                   layers_block_type=["mamba", "attention", "mlp", "mamba"],
                   num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                   mamba_num_heads=8, mamba_head_dim=16, ssm_state_size=16, n_groups=2,
                   conv_kernel=4, chunk_size=16, layer_norm_epsilon=1e-5,
                   tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0))


def perturb(name: str, p: torch.Tensor) -> None:
    if "norm" in name or name.endswith(("bias", ".D")):
        p.add_(torch.randn_like(p) * 0.3)
    elif name.endswith("A_log"):  # slow decays: the state carries far, so it must be right
        p.uniform_(-4.6, -2.3)


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    path = build_model(tmp_path_factory.mktemp("nemotron_h"), NEMOTRON_H, {}, seed=5,
                       perturb=perturb)
    ps = prompts()
    return "nemotron_h", path, ps, hf_greedy(path, ps)


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


def test_layers_state_and_refusals(family, tmp_path) -> None:
    config = ModelConfig.from_dir(family[1])
    assert config.layer_kinds == ("recurrent", "attention", "none", "recurrent")
    groups = config.kv_groups
    assert groups.num_state_layers == 2 and groups.num_kv_layers == 1
    assert config.kv_bytes_per_token(4) == 2 * 2 * 16 * 4  # the one attention layer's K/V
    moe = dict(config.hf, layers_block_type=["mamba", "attention", "moe", "mamba"])
    with pytest.raises(ValueError, match="MoE blocks are not supported"):
        from octavo.model.models.nemotron_h import NemotronHForCausalLM

        NemotronHForCausalLM(ModelConfig.from_hf_dict(moe), 64)
