"""Sample and prompt logprobs equal log_softmax of HF transformers' logits (fp32) at the same
positions: greedy and sampled tokens, across chunked prefill and prefix-cache hits."""

from __future__ import annotations

import random

import pytest
import torch

from octavo import LLM, SamplingParams
from tests.engine.conftest import hf_log_softmax, tokens_prompt

ATOL = 1e-3
K = 5


@pytest.fixture(scope="module")
def prompts(default_model_dir) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model_dir)
    rng = random.Random(11)
    return [
        tok.encode("The capital of France is"),
        tok.encode("def fibonacci(n):\n    "),
        [rng.randrange(3, tok.vocab_size) for _ in range(90)],
    ]


def check_position(entry, ref_row: torch.Tensor, chosen: int, k: int) -> None:
    """One position's logprobs dict against the reference log_softmax row."""
    assert chosen in entry
    top_vals, top_ids = ref_row.topk(k)
    ranked = [(tid, lp) for tid, lp in entry.items() if lp.rank is not None and lp.rank <= k]
    assert [lp.rank for _, lp in ranked] == list(range(1, k + 1))
    assert len(entry) in (k, k + 1)
    for tid, lp in entry.items():
        assert abs(lp.logprob - ref_row[tid].item()) < ATOL, (tid, lp, ref_row[tid].item())
    # the top-k really are the k most likely tokens (by value: ties may swap ids)
    ours = torch.tensor([lp.logprob for _, lp in ranked])
    assert torch.allclose(ours, top_vals, atol=ATOL)
    if set(tid for tid, _ in ranked) != set(top_ids.tolist()):
        # only a near-tie at the k-th place may differ
        assert (top_vals[-2] - top_vals[-1]).abs() < ATOL or k == 1
    # the chosen token's rank counts the tokens clearly more likely than it
    v = ref_row[chosen].item()
    lo = int((ref_row > v + ATOL).sum()) + 1
    hi = int((ref_row > v - ATOL).sum()) + 1
    assert lo <= entry[chosen].rank <= hi


def check_sample_logprobs(hf_model, prompt: list[int], completion) -> None:
    seq = prompt + list(completion.token_ids)
    ref = hf_log_softmax(hf_model, seq[:-1])
    assert len(completion.logprobs) == len(completion.token_ids)
    total = 0.0
    for j, (tok, entry) in enumerate(zip(completion.token_ids, completion.logprobs, strict=True)):
        row = ref[len(prompt) - 1 + j]
        check_position(entry, row, tok, K)
        total += entry[tok].logprob
    assert completion.cumulative_logprob == pytest.approx(total, abs=1e-4)


def check_prompt_logprobs(hf_model, prompt: list[int], prompt_logprobs, k: int) -> None:
    ref = hf_log_softmax(hf_model, prompt)
    assert len(prompt_logprobs) == len(prompt)
    assert prompt_logprobs[0] is None
    for t in range(1, len(prompt)):
        check_position(prompt_logprobs[t], ref[t - 1], prompt[t], k)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(num_kv_blocks=256)


def test_greedy_logprobs(llm, hf_model, prompts):
    params = SamplingParams(temperature=0, max_tokens=10, logprobs=K, ignore_eos=True)
    outs = llm.generate([tokens_prompt(p) for p in prompts], params, use_tqdm=False)
    for p, out in zip(prompts, outs, strict=True):
        c = out.outputs[0]
        assert all(c.logprobs[j][t].rank == 1 for j, t in enumerate(c.token_ids))  # greedy
        check_sample_logprobs(hf_model, p, c)
    assert llm.stats()["kv_blocks_used"] == 0


def test_sampled_logprobs_are_raw_model_logprobs(llm, hf_model, prompts):
    # temperature and penalties change the sampling distribution, not the reported logprobs
    params = SamplingParams(n=2, temperature=1.5, seed=5, max_tokens=8, logprobs=K,
                            repetition_penalty=1.3, ignore_eos=True)
    out = llm.generate(tokens_prompt(prompts[0]), params, use_tqdm=False)[0]
    for c in out.outputs:
        check_sample_logprobs(hf_model, prompts[0], c)
    assert any(c.logprobs[j][t].rank > 1 for c in out.outputs for j, t in enumerate(c.token_ids))


def test_prompt_logprobs(llm, hf_model, prompts):
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3)
    for _ in range(2):  # the second time the prompts' blocks are cached: still all computed
        outs = llm.generate([tokens_prompt(p) for p in prompts], params, use_tqdm=False)
        for p, out in zip(prompts, outs, strict=True):
            check_prompt_logprobs(hf_model, p, out.prompt_logprobs, 3)
    # prompt_logprobs=0: only the prompt token's own logprob
    out = llm.generate(tokens_prompt(prompts[2]),
                       SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0),
                       use_tqdm=False)[0]
    ref = hf_log_softmax(hf_model, prompts[2])
    for t in range(1, len(prompts[2])):
        entry = out.prompt_logprobs[t]
        assert list(entry) == [prompts[2][t]]
        assert abs(entry[prompts[2][t]].logprob - ref[t - 1, prompts[2][t]].item()) < ATOL
    assert llm.stats()["kv_blocks_used"] == 0


def test_prompt_and_sample_logprobs_under_chunked_prefill(hf_model, prompts):
    llm = LLM(num_kv_blocks=64, max_num_batched_tokens=16)
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=K, prompt_logprobs=2,
                            ignore_eos=True)
    outs = llm.generate([tokens_prompt(p) for p in prompts], params, use_tqdm=False)
    for p, out in zip(prompts, outs, strict=True):
        check_prompt_logprobs(hf_model, p, out.prompt_logprobs, 2)
        check_sample_logprobs(hf_model, p, out.outputs[0])
    assert llm.stats()["kv_blocks_used"] == 0


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_prompt_logprobs_survive_preemption(hf_model, prompts, mode):
    """A request preempted while (or after) its prompt is scored recomputes that prompt: each
    position's prompt logprobs still appear exactly once, and equal HF's."""
    llm = LLM(num_kv_blocks=10, block_size=16, max_num_batched_tokens=32, max_model_len=160,
              preemption_mode=mode)
    engine = llm.engine
    first = engine.add_request("first", tokens_prompt(prompts[2]), SamplingParams(
        temperature=0, max_tokens=60, ignore_eos=True))
    scored = engine.add_request("scored", tokens_prompt(prompts[2][:80]), SamplingParams(
        temperature=0, max_tokens=8, prompt_logprobs=2, ignore_eos=True))
    outs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out
        engine.check_invariants()
    assert scored.num_preemptions > 0 and first.num_preemptions == 0
    check_prompt_logprobs(hf_model, prompts[2][:80], outs["scored"].prompt_logprobs, 2)
    assert llm.stats()["kv_blocks_used"] == 0
