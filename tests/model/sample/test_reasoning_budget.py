"""The reasoning budget: which token closes a thinking section that ran too long, and the
sampler sampling it whatever the logits say (unless a constraint forbids it)."""

from __future__ import annotations

import torch

from octavo.model.sample.metadata import SamplingMetadata
from octavo.model.sample.reasoning_budget import forced_reasoning_token
from octavo.model.sample.sampler import Sampler
from octavo.sampling_params import SamplingParams

START, END = [7, 8], [5, 6, 9]  # "<think>" and "</think>" as token ids
V = 16


def params(budget: int | None, **kw) -> SamplingParams:
    return SamplingParams(thinking_token_budget=budget, think_start_token_ids=START,
                          think_end_token_ids=END, **kw)


def test_the_end_marker_is_forced_token_by_token_once_the_budget_is_spent():
    prompt = [1, 2, *START]  # the template opened the reasoning
    p = params(3)
    assert forced_reasoning_token(p, prompt + [3, 3], len(prompt)) is None  # 2 of 3
    assert forced_reasoning_token(p, prompt + [3, 3, 3], len(prompt)) == 5
    assert forced_reasoning_token(p, prompt + [3, 3, 3, 5], len(prompt)) == 6
    assert forced_reasoning_token(p, prompt + [3, 3, 3, 5, 6], len(prompt)) == 9
    assert forced_reasoning_token(p, prompt + [3, 3, 3, *END], len(prompt)) is None  # closed
    assert forced_reasoning_token(p, prompt + [3, 3, 3, *END, 4, 4, 4, 4], len(prompt)) is None
    # the model began the end marker itself: the rest of it follows
    assert forced_reasoning_token(p, prompt + [3, 5, 6], len(prompt)) == 9


def test_reasoning_opened_by_the_model_and_budget_zero():
    prompt = [1, 2]
    assert forced_reasoning_token(params(2), prompt + [4, 4], 2) is None  # not thinking
    assert forced_reasoning_token(params(2), prompt + [*START, 4], 2) is None
    assert forced_reasoning_token(params(2), prompt + [*START, 4, 4], 2) == 5
    assert forced_reasoning_token(params(0), [*START], 2) == 5  # close at once
    # an earlier turn's closed reasoning in the prompt does not count
    history = [*START, 4, *END, 1]
    assert forced_reasoning_token(params(1), history + [4, 4, 4], len(history)) is None
    assert forced_reasoning_token(params(None), prompt + [*START, 4, 4, 4, 4], 2) is None


def test_the_sampler_samples_the_forced_token_unless_a_constraint_forbids_it():
    tokens = [1, *START, 3, 3]
    logits = torch.zeros(2, V)
    logits[:, 3] = 50.0  # the model wants 3
    rows = [params(2, temperature=1.0, seed=1),
            params(2, temperature=0.0, allowed_token_ids=[3, 4])]  # 5 not allowed
    meta = SamplingMetadata.from_params(rows, [tokens, tokens], [3, 3], V)
    assert meta.forced == [(0, 5), (1, 5)]
    assert Sampler()(logits, meta).sampled_token_ids == [5, 3]
