"""Cheap exactness check on the tiny random model: a greedy batch gives the same tokens as the
same prompts run one by one, for every block size, with and without chunked prefill."""

from __future__ import annotations

import random

import pytest

from octavo import LLM, SamplingParams
from tests.engine.conftest import tokens_prompt

LENGTHS = [1, 2, 7, 8, 9, 16, 17, 31, 64, 100, 200]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(8)
    shared = [rng.randrange(3, 256) for _ in range(40)]
    out = [[rng.randrange(3, 256) for _ in range(n)] for n in LENGTHS]
    out += [shared + [rng.randrange(3, 256) for _ in range(n)] for n in (1, 9, 30)]
    return out


@pytest.fixture(scope="module")
def alone(tiny_llama_dir, prompts) -> list[list[int]]:
    llm = LLM(str(tiny_llama_dir), block_size=16, num_kv_blocks=64,
              enable_prefix_caching=False)
    return [
        llm.generate(tokens_prompt(p), GREEDY, use_tqdm=False)[0].outputs[0].token_ids
        for p in prompts
    ]


@pytest.mark.parametrize("block_size", [1, 8, 16, 64, 256])
@pytest.mark.parametrize("budget", [2048, 24], ids=["whole", "chunked"])
def test_batch_equals_alone(tiny_llama_dir, prompts, alone, block_size, budget):
    llm = LLM(str(tiny_llama_dir), block_size=block_size,
              num_kv_blocks=max(8, 8192 // block_size), max_num_batched_tokens=budget)
    outs = llm.generate([tokens_prompt(p) for p in prompts], GREEDY, use_tqdm=False)
    for i, out in enumerate(outs):
        assert out.outputs[0].token_ids == alone[i], f"prompt {i} ({len(prompts[i])} tokens)"
    stats = llm.stats()
    assert stats["kv_blocks_used"] == 0
    assert stats["prefix_cache_hit_tokens"] > 0 or block_size > 40
