"""SmolLM3, as a tiny random-weight HF model built here, gives HF transformers' greedy tokens in
fp32 under every engine configuration of test_families.py (batched and alone, block sizes
1 / 16 / 256, prefix caching on and off, preemption with chunked prefill), with n = 4 and beam
search: layers 4 and 8 of eight attend without RoPE, which a model that rotated them would get
wrong."""

from __future__ import annotations

import pytest

from octavo.config import ModelConfig
from tests.model.models.hybrid_checks import KV_BYTES, check_n4_and_beams
from tests.model.models.test_families import (
    COMMON,
    CONFIGS,
    build_model,
    check_greedy,
    hf_greedy,
    perturb_biases_and_norms,
    prompts,
)

SMOLLM3 = ("SmolLM3Config", "SmolLM3ForCausalLM",
           dict(num_hidden_layers=8, head_dim=16, attention_bias=True, pad_token_id=0,
                rope_parameters={"rope_type": "default", "rope_theta": 1000.0}))


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    path = build_model(tmp_path_factory.mktemp("smollm3"), SMOLLM3, COMMON, seed=5,
                       perturb=perturb_biases_and_norms)
    ps = prompts()
    return "smollm3", path, ps, hf_greedy(path, ps)


@pytest.mark.parametrize("config", list(CONFIGS))
def test_greedy_equals_transformers(family, config) -> None:
    llm = check_greedy(*family, config, kv_cache_memory_bytes=KV_BYTES)
    model = llm.engine.runner.model
    assert [layer.self_attn.rope for layer in model.layers] == [True, True, True, False] * 2


def test_n4_and_beam_search(family) -> None:
    check_n4_and_beams(family[1], family[2][5])


def test_config_windows_on_nope_layers_only() -> None:
    """With use_sliding_window the NoPE layers slide and the others attend fully."""
    import transformers

    hf = transformers.SmolLM3Config(**{**COMMON, **SMOLLM3[2], "use_sliding_window": True,
                                       "sliding_window": 32})
    ours = ModelConfig.from_hf_dict(hf.to_dict())
    assert ours.layer_windows == (None, None, None, 32) * 2
    legacy = {k: v for k, v in hf.to_dict().items() if k != "layer_types"}
    assert ModelConfig.from_hf_dict(legacy).layer_windows == ours.layer_windows
