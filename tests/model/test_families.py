"""Every supported family, as a tiny random-weight HF model built here, gives HF transformers'
greedy tokens in fp32: batched and one by one, block sizes 1 / 16 / 256, prefix caching on and
off, under preemption, with chunked prefill. Real head / kv-head ratios (grouped queries)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from octavo import LLM, SamplingParams
from octavo.config import ModelConfig
from tests.conftest import build_byte_tokenizer

MAX_TOKENS = 32
COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
              rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)

FAMILIES = {
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": None}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"use_sliding_window": False}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 32, "use_sliding_window": False,
                                                  "tie_word_embeddings": True}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"pad_token_id": 0}),
}


def build(path: Path, family: str, **overrides) -> Path:
    import transformers

    config_cls, model_cls, extra = FAMILIES[family]
    torch.manual_seed(1)
    config = getattr(transformers, config_cls)(**{**COMMON, **extra, **overrides})
    model = getattr(transformers, model_cls)(config).eval()
    # random init leaves biases at zero: give Qwen2's qkv bias something to get wrong
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(path, safe_serialization=True)
    build_byte_tokenizer(path)
    return path


def hf_greedy(path: Path, prompts: list[list[int]], **load: str) -> list[list[int]]:
    """transformers' greedy MAX_TOKENS after each prompt; `load`: from_pretrained options."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **load).eval()
    model.generation_config.eos_token_id = None
    refs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=MAX_TOKENS, pad_token_id=0)
            refs.append(out[0, len(p):].tolist())
    return refs


def prompts() -> list[list[int]]:
    """8 prompts of 3..160 tokens, four sharing a 64-token prefix."""
    rng = random.Random(7)

    def rand(n: int) -> list[int]:
        return [rng.randrange(3, 256) for _ in range(n)]

    prefix = rand(64)
    return [rand(3), rand(37), rand(100), rand(160)] + [prefix + rand(n)
                                                        for n in (5, 30, 60, 96)]


GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
CONFIGS = {
    "batched-bs16-cache": dict(block_size=16, enable_prefix_caching=True),
    "bs1-nocache": dict(block_size=1, enable_prefix_caching=False),
    "bs256": dict(block_size=256, num_kv_blocks=8),
    "preempt-chunked": dict(block_size=16, num_kv_blocks=24, max_num_batched_tokens=48,
                            enable_prefix_caching=True),
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    path = build(tmp_path_factory.mktemp(request.param), request.param)
    ps = prompts()
    return request.param, path, ps, hf_greedy(path, ps)


def check_greedy(name: str, path: Path, ps: list[list[int]], refs: list[list[int]],
                 config: str) -> LLM:
    """octavo under CONFIGS[config] gives `refs` (batched, and one by one at block size 1),
    preempts where it should, and returns every block; the engine, for further checks."""
    llm = LLM(model=str(path), **CONFIGS[config])
    assert llm.engine.model_config.model_type == name
    outs = llm.generate([{"prompt_token_ids": p} for p in ps], GREEDY, use_tqdm=False)
    for i, out in enumerate(outs):
        assert out.outputs[0].token_ids == refs[i], f"{name} {config}: prompt {i} differs"
    stats = llm.stats()
    if config == "preempt-chunked":
        assert stats["num_preemptions"] > 0
    assert stats["kv_blocks_used"] == 0
    if config == "bs1-nocache":  # one by one too
        for i, p in enumerate(ps[:3]):
            got = llm.generate([{"prompt_token_ids": p}], GREEDY, use_tqdm=False)[0]
            assert got.outputs[0].token_ids == refs[i]
    return llm


@pytest.mark.parametrize("config", list(CONFIGS))
def test_greedy_equals_transformers(family, config) -> None:
    check_greedy(*family, config)


def test_a_sliding_window_caps_max_model_len(tmp_path) -> None:
    """A Mistral with a 128-token window runs with full attention up to the window (the same
    thing there), and refuses a longer max_model_len with the reason."""
    path = build(tmp_path / "m", "mistral", sliding_window=128)
    assert ModelConfig.from_dir(path).sliding_window == 128
    llm = LLM(model=str(path), num_kv_blocks=64)
    assert llm.engine.max_model_len == 128
    ps = [p for p in prompts() if len(p) + MAX_TOKENS <= 128]
    outs = llm.generate([{"prompt_token_ids": p} for p in ps], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(path, ps)
    with pytest.raises(ValueError, match="sliding window"):
        LLM(model=str(path), num_kv_blocks=64, max_model_len=256)


def test_unsupported_model_type_lists_the_supported(tmp_path) -> None:
    with pytest.raises(ValueError, match="llama, mistral, qwen2, qwen3, phi3"):
        ModelConfig.from_hf_dict({"model_type": "bert"})
