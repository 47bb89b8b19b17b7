"""Every supported family, as a tiny random-weight HF model built here, gives HF transformers'
greedy tokens in fp32: batched and one by one, block sizes 1 / 16 / 256, prefix caching on and
off, under preemption, with chunked prefill. Real head / kv-head ratios (grouped queries).
Sliding windows (40-56 tokens) shorter than most prompts (3..160 tokens, plus 32 generated), so
the window really cuts and its blocks really go back to the pool; Qwen2 and Qwen3 slide on some
layers only (max_window_layers), which makes them hybrid KV caches of several groups."""

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

# name (model_type, or model_type-variant) -> HF config class, model class, config overrides
FAMILIES = {
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 40}),
    "mistral-full": ("MistralConfig", "MistralForCausalLM", {"sliding_window": None}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"use_sliding_window": True,
                                                  "sliding_window": 48, "max_window_layers": 1}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 32, "use_sliding_window": True,
                                                  "sliding_window": 40, "max_window_layers": 2,
                                                  "tie_word_embeddings": True}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"pad_token_id": 0, "sliding_window": 56}),
}


def build_model(path: Path, spec: tuple[str, str, dict], common: dict, *, seed: int,
                perturb, eager: bool = False, **overrides) -> Path:
    """Save a random-weight HF model: `spec` is (config class, model class, config overrides)
    over `common`; `perturb(name, param)` gives the weights random init leaves trivial
    something to get wrong. With the byte tokenizer."""
    import transformers

    config_cls, model_cls, extra = spec
    torch.manual_seed(seed)
    config = getattr(transformers, config_cls)(**{**common, **extra, **overrides})
    if eager:
        config._attn_implementation = "eager"
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            perturb(name, p)
    model.save_pretrained(path, safe_serialization=True)
    build_byte_tokenizer(path)
    return path


def perturb_biases_and_norms(name: str, p: torch.Tensor) -> None:
    """Random init leaves biases at zero and norms at one: give Qwen2's qkv bias and the
    norms something to get wrong."""
    if name.endswith("bias") or "norm" in name:
        p.add_(torch.randn_like(p) * 0.1)


def build(path: Path, family: str, **overrides) -> Path:
    return build_model(path, FAMILIES[family], COMMON, seed=1,
                       perturb=perturb_biases_and_norms, **overrides)


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
                 config: str, **engine) -> LLM:
    """octavo under CONFIGS[config] (and `engine` options: kernels, say) gives `refs`
    (batched, and one by one at block size 1), preempts where it should, and returns every
    block; the engine, for further checks."""
    model = ModelConfig.from_dir(path)
    args = dict(CONFIGS[config])
    if "num_kv_blocks" in args:  # the same memory: a hybrid cache's blocks hold fewer layers
        args["num_kv_blocks"] *= model.kv_groups.num_groups
    llm = LLM(model=str(path), **args, **engine)
    assert llm.engine.model_config.model_type == name.split("-")[0]
    outs = llm.generate([{"prompt_token_ids": p} for p in ps], GREEDY, use_tqdm=False)
    for i, out in enumerate(outs):
        assert out.outputs[0].token_ids == refs[i], f"{name} {config}: prompt {i} differs"
    stats = llm.stats()
    windows = [w for w in model.layer_windows if w is not None]
    if windows and max(windows) + CONFIGS[config].get("block_size", 16) < max(map(len, ps)):
        assert stats["kv_blocks_freed_out_of_window"] > 0, "the window never freed a block"
    if config == "preempt-chunked":
        assert stats["num_preemptions"] > 0
    assert stats["kv_blocks_used"] == 0
    if config == "batched-bs16-cache":  # again, now from the prefix cache (every group's)
        again = llm.generate([{"prompt_token_ids": p} for p in ps], GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in again] == refs, f"{name}: cached run differs"
        assert llm.stats()["prefix_cache_hit_tokens"] > stats["prefix_cache_hit_tokens"]
    if config == "bs1-nocache":  # one by one too
        for i, p in enumerate(ps[:3]):
            got = llm.generate([{"prompt_token_ids": p}], GREEDY, use_tqdm=False)[0]
            assert got.outputs[0].token_ids == refs[i]
    return llm


@pytest.mark.parametrize("config", list(CONFIGS))
def test_greedy_equals_transformers(family, config) -> None:
    check_greedy(*family, config)


def test_layer_windows_follow_transformers(tmp_path) -> None:
    """Which layers slide, and the KV cache groups that follow from it."""
    import transformers

    for name, (config_cls, _, extra) in FAMILIES.items():
        hf = getattr(transformers, config_cls)(**{**COMMON, **extra})
        ours = ModelConfig.from_hf_dict(hf.to_dict())
        types = getattr(hf, "layer_types", None) or ["sliding_attention" if hf.sliding_window
                                                     else "full_attention"] * 3
        window = hf.sliding_window
        assert ours.layer_windows == tuple(window if t == "sliding_attention" else None
                                           for t in types), name
    qwen2 = ModelConfig.from_hf_dict(transformers.Qwen2Config(
        **{**COMMON, **FAMILIES["qwen2"][2]}).to_dict()).kv_groups
    assert qwen2.windows == (None, 48, 48) and qwen2.slots_per_group == 1
    mistral = ModelConfig.from_hf_dict(transformers.MistralConfig(
        **{**COMMON, **FAMILIES["mistral"][2]}).to_dict()).kv_groups
    assert mistral.windows == (40,) and mistral.slots_per_group == 3


def test_unsupported_model_type_lists_the_supported(tmp_path) -> None:
    with pytest.raises(ValueError, match="llama, mistral, qwen2, qwen3, phi3"):
        ModelConfig.from_hf_dict({"model_type": "bert"})


def test_phi3_longrope_equals_transformers(tmp_path) -> None:
    """Phi-3's LongRoPE (the 128k models): per-frequency short factors and the attention
    factor below the original context, where transformers and octavo agree."""
    rng = random.Random(3)
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "attention_factor": 1.6,
            "short_factor": [1.0 + rng.random() for _ in range(8)],
            "long_factor": [2.0 + 4 * rng.random() for _ in range(8)]}
    path = build(tmp_path / "p", "phi3", rope_parameters=rope,
                 original_max_position_embeddings=256, sliding_window=None)
    config = ModelConfig.from_dir(path)
    assert config.rope_scaling is not None and config.rope_scaling["rope_type"] == "longrope"
    ps = prompts()
    check_greedy("phi3", path, ps, hf_greedy(path, ps), "batched-bs16-cache")
