"""Greedy tokens of the embedded model equal HF transformers (fp32) token for token, under every
engine configuration that changes *how* the work is done but must not change *what* is computed:
preemption (recompute, swap), chunked prefill, prefix caching on and off, block sizes, and the
priority policy. Each run ends with every KV block back in the pool."""

from __future__ import annotations

import random

import pytest

from octavo import LLM, SamplingParams
from tests.engine.conftest import hf_greedy, tokens_prompt

MAX_TOKENS = 24
PREFIX_LEN = 150
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts(default_model_dir) -> list[list[int]]:
    """8 prompts of 5..300 tokens: a text prompt, random-token prompts, and 4 prompts sharing a
    150-token prefix (prefix caching has something to find)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model_dir)
    rng = random.Random(4)

    def rand(n: int) -> list[int]:
        return [rng.randrange(3, tok.vocab_size) for _ in range(n)]

    prefix = rand(PREFIX_LEN)
    out = [tok.encode("The capital of France is")]
    out += [rand(40), rand(90), rand(130)]
    out += [prefix + rand(n) for n in (20, 60, 100, 150)]
    lengths = [len(p) for p in out]
    assert min(lengths) <= 8 and max(lengths) == 300
    return out


@pytest.fixture(scope="module")
def references(hf_model, prompts) -> list[list[int]]:
    refs = hf_greedy(hf_model, prompts, MAX_TOKENS)
    assert all(len(r) == MAX_TOKENS for r in refs)
    return refs


class StepRecorder:
    """Wraps the scheduler to record what each step really did."""

    def __init__(self, llm: LLM) -> None:
        self.swap_out = self.swap_in = self.tokens = 0
        self.chunks: list[int] = []
        self.step_tokens: list[int] = []
        scheduler = llm.engine.scheduler
        inner = scheduler.schedule

        def schedule():
            plan = inner()
            self.swap_out += len(plan.swap_out)
            self.swap_in += len(plan.swap_in)
            self.tokens += plan.num_tokens
            self.step_tokens.append(plan.num_tokens)
            self.chunks.extend(len(c.token_ids) for c in plan.chunks)
            return plan

        scheduler.schedule = schedule


def run_and_check(llm: LLM, prompts, references, priority=None):
    outs = llm.generate(
        [tokens_prompt(p) for p in prompts], GREEDY, use_tqdm=False, priority=priority
    )
    for i, out in enumerate(outs):
        assert out.prompt_token_ids == prompts[i]
        got = out.outputs[0].token_ids
        assert got == references[i], f"prompt {i} ({len(prompts[i])} tokens) differs from HF"
        assert out.outputs[0].finish_reason == "length"
    stats = llm.stats()
    assert stats["kv_blocks_used"] == 0
    assert stats["kv_cpu_blocks_used"] == 0
    assert stats["num_requests_running"] == stats["num_requests_waiting"] == 0
    assert stats["num_requests_swapped"] == 0
    llm.engine.kv.check_invariants()
    return stats


def tight_llm(block_size: int, num_blocks: int, **kw) -> LLM:
    # The longest sequence (300 + 24 tokens) fits alone; the batch does not fit at once.
    assert num_blocks * block_size >= 300 + MAX_TOKENS
    return LLM(
        block_size=block_size, num_kv_blocks=num_blocks,
        max_model_len=num_blocks * block_size, **kw,
    )


@pytest.mark.parametrize(
    "block_size,num_blocks,caching",
    [(16, 23, False)],
    ids=["bs16-nocache"],
)
def test_preemption_recompute(prompts, references, block_size, num_blocks, caching):
    llm = tight_llm(block_size, num_blocks, preemption_mode="recompute",
                    enable_prefix_caching=caching)
    steps = StepRecorder(llm)
    stats = run_and_check(llm, prompts, references)
    assert stats["num_preemptions"] > 0
    assert steps.swap_out == steps.swap_in == 0
    if not caching:  # the preempted request's tokens really were computed again
        assert steps.tokens > sum(map(len, prompts)) + len(prompts) * (MAX_TOKENS - 1)


@pytest.mark.parametrize(
    "block_size,num_blocks,caching",
    [(8, 47, True)],
    ids=["bs8-cache"],
)
def test_preemption_swap(prompts, references, block_size, num_blocks, caching):
    llm = tight_llm(block_size, num_blocks, preemption_mode="swap",
                    enable_prefix_caching=caching)
    steps = StepRecorder(llm)
    stats = run_and_check(llm, prompts, references)
    assert stats["num_preemptions"] > 0
    assert steps.swap_out > 0 and steps.swap_in > 0
    assert stats["kv_cpu_blocks_total"] > 0


def test_chunked_prefill(prompts, references):
    budget = 32
    llm = LLM(max_num_batched_tokens=budget, num_kv_blocks=256, enable_prefix_caching=False)
    steps = StepRecorder(llm)
    assert max(map(len, prompts)) > budget
    run_and_check(llm, prompts, references)
    assert max(steps.step_tokens) <= budget
    # every prompt longer than the budget was split over several steps
    prefill_chunks = sum(-(-len(p) // budget) for p in prompts)
    assert len(steps.chunks) >= prefill_chunks + len(prompts) * (MAX_TOKENS - 1)


@pytest.mark.parametrize("caching", [True, False], ids=["cache-on", "cache-off"])
def test_prefix_caching(prompts, references, caching):
    llm = LLM(num_kv_blocks=256, enable_prefix_caching=caching)
    stats = run_and_check(llm, prompts, references)
    if caching:
        # three prompts find the shared prefix's full blocks (150 tokens = 9 blocks of 16)
        assert stats["prefix_cache_hit_tokens"] >= 3 * (PREFIX_LEN // 16) * 16
        assert stats["prompt_tokens_total"] < sum(map(len, prompts))
        # a second pass finds all prompts' full blocks
        before = stats["prefix_cache_hit_tokens"]
        stats = run_and_check(llm, prompts[-2:], references[-2:])
        assert stats["prefix_cache_hit_tokens"] - before >= sum(
            (len(p) - 1) // 16 * 16 for p in prompts[-2:]
        )
    else:
        assert stats["prefix_cache_hit_tokens"] == 0
        assert stats["prompt_tokens_total"] == sum(map(len, prompts))


@pytest.mark.parametrize("block_size", [1, 256])
def test_block_sizes(prompts, references, block_size):
    # (block size 16 is the default of the other tests in this module)
    llm = LLM(block_size=block_size, num_kv_blocks=(4096 // block_size))
    run_and_check(llm, prompts, references)


def test_priority_policy_exact(prompts, references):
    # Tight memory, so the policy decides who runs and who is preempted.
    llm = tight_llm(16, 26, preemption_mode="recompute", scheduling_policy="priority")
    priority = [3, 0, 2, 1, 5, 4, 0, 7]
    stats = run_and_check(llm, prompts, references, priority=priority)
    assert stats["num_preemptions"] > 0


SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
        "prompt_lookup_max": 3, "cost_model": False}


def assert_speculated(llm: LLM) -> None:
    s = llm.stats()
    assert s["spec_decode_num_drafts"] > 0
    assert 0 < s["spec_decode_num_accepted_tokens"] < s["spec_decode_num_draft_tokens"]


@pytest.mark.parametrize("block_size", [1, 16])
def test_speculative_decoding_batched(prompts, references, block_size):
    """n-gram drafts verified in the batch (every draft sent: no cost model) give HF's
    greedy tokens."""
    llm = LLM(block_size=block_size, num_kv_blocks=4096 // block_size, speculative_config=SPEC)
    run_and_check(llm, prompts, references)
    assert_speculated(llm)


def test_speculative_decoding_alone(prompts, references):
    llm = LLM(num_kv_blocks=256, speculative_config=SPEC)
    for p, ref in zip(prompts, references, strict=True):
        run_and_check(llm, [p], [ref])
    assert_speculated(llm)


def test_speculative_decoding_with_preemption_and_chunked_prefill(prompts, references):
    llm = tight_llm(16, 23, preemption_mode="recompute", max_num_batched_tokens=64,
                    speculative_config=SPEC)
    steps = StepRecorder(llm)
    stats = run_and_check(llm, prompts, references)
    assert stats["num_preemptions"] > 0
    assert max(steps.step_tokens) <= 64
    assert_speculated(llm)


def test_self_draft_batched(prompts, references):
    """Drafts from the model's own first 8 layers, every one sent (no cost model)."""
    llm = LLM(num_kv_blocks=256, speculative_config={
        "method": "self_draft", "num_speculative_tokens": 3, "num_draft_layers": 8,
        "cost_model": False})
    run_and_check(llm, prompts, references)
    s = llm.stats()
    assert s["spec_decode_num_draft_tokens"] > 0
