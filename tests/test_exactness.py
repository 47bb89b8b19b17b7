"""Greedy tokens of the embedded model equal transformers' generate (fp32), token for token,
for every block size, whether the prompts run in one batch or one by one."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from octavo import LLM, SamplingParams
from octavo.config import ModelConfig
from octavo.engine_args import EngineArgs
from octavo.model.kernels.cpu_isa import supported_isas
from octavo.model.worker.runner import ModelRunner
from octavo.step_plan import StepPlan
from tests.engine.conftest import hf_greedy
from tests.model.plans import chunk, new_seq

MAX_TOKENS = 32
TEXTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a land far away,",
    "List three colors:",
    "Translate to German: good morning",
    "1, 2, 3, 4,",
]
# random token prompts spread over 1..1500 tokens
LENGTHS = [1, 2, 7, 16, 17, 63, 100, 255, 256, 300, 511, 700, 1000, 1500]


def exactness_prompts(model_dir) -> list[list[int]]:
    """The texts and the random prompts of 1 to 1500 tokens (tests/gpu reuses them)."""
    tok = AutoTokenizer.from_pretrained(model_dir)
    rng = random.Random(1234)
    out = [tok.encode(t) for t in TEXTS]
    out += [[rng.randrange(0, 49152) for _ in range(n)] for n in LENGTHS]
    assert len(out) >= 20 and min(map(len, out)) == 1 and max(map(len, out)) == 1500
    return out


@pytest.fixture(scope="module")
def prompts(default_model_dir) -> list[list[int]]:
    return exactness_prompts(default_model_dir)


@pytest.fixture(scope="module")
def hf_model(default_model_dir):
    model = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()
    # ignore_eos: generate must neither stop at EOS nor suppress it (min_new_tokens would)
    model.generation_config.eos_token_id = None
    return model


@pytest.fixture(scope="module")
def hf_tokens(hf_model, prompts) -> list[list[int]]:
    refs = hf_greedy(hf_model, prompts, MAX_TOKENS)
    assert all(len(r) == MAX_TOKENS for r in refs)
    return refs


GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.mark.parametrize("block_size", [1, 16, 256])
def test_greedy_matches_transformers(default_model_dir, prompts, hf_tokens, block_size):
    llm = LLM(block_size=block_size, kv_cache_memory_bytes=1 << 30)
    batched = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    for i, out in enumerate(batched):
        assert out.prompt_token_ids == prompts[i]
        assert out.outputs[0].token_ids == hf_tokens[i], f"batched prompt {i} ({len(prompts[i])})"
        assert out.outputs[0].finish_reason == "length"
    for i in range(0, len(prompts), 4 if block_size != 16 else 1):  # one by one
        out = llm.generate({"prompt_token_ids": prompts[i]}, GREEDY, use_tqdm=False)[0]
        assert out.outputs[0].token_ids == hf_tokens[i], f"alone prompt {i} ({len(prompts[i])})"
    assert llm.stats()["kv_blocks_used"] == 0


@pytest.mark.parametrize("isa", supported_isas()[1:])
def test_greedy_matches_transformers_on_lower_isas(default_model_dir, prompts, hf_tokens, isa):
    """The AVX2 and portable builds of the compiled ops (forced on a CPU that has a better one)
    give transformers' greedy tokens too; the run reports the path it took."""
    llm = LLM(block_size=16, kv_cache_memory_bytes=1 << 30, cpu_isa=isa)
    assert llm.engine.runner.kernel_path()["isa"] == isa
    assert llm.engine.runner.backend.isa == isa
    some = range(0, len(prompts), 3)  # texts and random prompts of 1 to 1000 tokens
    out = llm.generate([{"prompt_token_ids": prompts[i]} for i in some], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in out] == [hf_tokens[i] for i in some]
    assert llm.stats()["kv_blocks_used"] == 0


def test_last_position_logits_match(default_model_dir, prompts, hf_model):
    config = ModelConfig.from_dir(default_model_dir)
    runner = ModelRunner(EngineArgs(block_size=16, max_model_len=2048), default_model_dir, config)
    runner.init_kv_cache(128)
    worst = 0.0
    for i, p in enumerate(prompts[::2]):
        table = list(range(-(-len(p) // 16)))[::-1]  # reversed: physical order is irrelevant
        plan = StepPlan([chunk(i, p, 0)], [new_seq(i, p, table)], finished_seq_ids=[i - 1])
        ours = runner.forward(plan).sample[0]
        with torch.no_grad():
            ref = hf_model(torch.tensor([p])).logits[0, -1]
        worst = max(worst, (ours - ref).abs().max().item())
    assert worst < 1e-3
