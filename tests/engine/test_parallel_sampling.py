"""Parallel sampling (n > 1) shares the prompt's blocks; seeded sampling is reproducible and
independent of whatever else is in the batch."""

from __future__ import annotations

import random

import pytest

from octavo import LLM, SamplingParams
from tests.engine.conftest import tokens_prompt

PROMPT_LEN = 410  # 25 full blocks of 16 and a partial one: the children copy it on write
BLOCK = 16


def test_n4_shares_prompt_blocks():
    prompt = [random.Random(0).randrange(3, 49152) for _ in range(PROMPT_LEN)]
    prompt_blocks = -(-PROMPT_LEN // BLOCK)
    n, max_tokens = 4, 12
    # Four private copies would need 4 x 27 blocks; give room for about one and a half.
    llm = LLM(block_size=BLOCK, num_kv_blocks=40, max_model_len=640)
    engine = llm.engine
    params = SamplingParams(n=n, temperature=0.8, seed=3, max_tokens=max_tokens, ignore_eos=True)
    engine.add_request("r", tokens_prompt(prompt), params)
    saved, used, last = [], [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            last = out
        engine.check_invariants()
        s = engine.stats()
        saved.append(s["kv_blocks_saved_by_sharing"])
        used.append(s["kv_blocks_used"])
    stats = engine.stats()
    assert last is not None and last.finished and len(last.outputs) == n
    assert all(len(o.token_ids) == max_tokens for o in last.outputs)
    assert stats["num_preemptions"] == 0
    # about one prompt's blocks: the prompt once, plus per sample a copied last block and
    # a block for its own tokens
    assert prompt_blocks <= stats["peak_kv_blocks_used"] <= prompt_blocks + 2 * n
    assert stats["peak_kv_blocks_used"] == max(used)
    # the n - 1 children share (at least) the parent's 25 full prompt blocks
    assert max(saved) >= (n - 1) * (PROMPT_LEN // BLOCK)
    assert stats["kv_blocks_used"] == 0 and stats["kv_blocks_saved_by_sharing"] == 0


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(num_kv_blocks=256)


SEEDED = SamplingParams(temperature=0.8, seed=1234, max_tokens=16, ignore_eos=True)


def test_seeded_sample_same_alone_and_in_batch(llm):
    target = "Once upon a time, in a land far away,"
    alone = llm.generate(target, SEEDED, use_tqdm=False)[0].outputs[0].token_ids
    again = llm.generate(target, SEEDED, use_tqdm=False)[0].outputs[0].token_ids
    assert alone == again
    rng = random.Random(5)
    others = [
        ("The capital of France is", SamplingParams(temperature=0, max_tokens=20)),
        (tokens_prompt([rng.randrange(3, 49152) for _ in range(200)]),
         SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True)),  # unseeded
        ("def fibonacci(n):", SamplingParams(temperature=0.8, seed=99, max_tokens=24)),
        ("List three colors:", SamplingParams(n=2, temperature=1.2, max_tokens=12)),
    ]
    prompts = [p for p, _ in others[:2]] + [target] + [p for p, _ in others[2:]]
    params = [p for _, p in others[:2]] + [SEEDED] + [p for _, p in others[2:]]
    batched = llm.generate(prompts, params, use_tqdm=False)
    assert batched[2].outputs[0].token_ids == alone
    # a different seed gives a different sample (the seed is really used)
    other_seed = SamplingParams(temperature=0.8, seed=4321, max_tokens=16, ignore_eos=True)
    assert llm.generate(target, other_seed, use_tqdm=False)[0].outputs[0].token_ids != alone
    assert llm.stats()["kv_blocks_used"] == 0


def test_seeded_n_samples_distinct_and_reproducible(llm):
    params = SamplingParams(n=3, temperature=0.8, seed=7, max_tokens=16, ignore_eos=True)
    prompt = "Once upon a time"
    first = llm.generate(prompt, params, use_tqdm=False)[0].outputs
    assert [o.index for o in first] == [0, 1, 2]
    samples = [tuple(o.token_ids) for o in first]
    assert len(set(samples)) == 3, "n samples with one seed must differ from each other"
    second = llm.generate(prompt, params, use_tqdm=False)[0].outputs
    assert [tuple(o.token_ids) for o in second] == samples
    # and inside a batch, behind another request
    batched = llm.generate(
        ["The capital of France is", prompt],
        [SamplingParams(temperature=0, max_tokens=8), params], use_tqdm=False,
    )[1].outputs
    assert [tuple(o.token_ids) for o in batched] == samples
    assert llm.stats()["kv_blocks_used"] == 0
