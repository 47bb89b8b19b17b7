"""Sampler: greedy, filters, penalties against a naive reference, seeds, logprobs, min_tokens."""

from __future__ import annotations

import math

import pytest
import torch

from octavo.model.sample.metadata import SamplingMetadata
from octavo.model.sample.sampler import (
    Sampler,
    apply_min_p,
    apply_top_k_top_p,
    compute_logprobs,
    row_argmax,
)
from octavo.sampling_params import SamplingParams

V = 64
sampler = Sampler()


def batch(params, prompts=None, outputs=None, vocab=V, eos=None, indices=None):
    """Rows' settings as the runner builds them: each row's sequence holds prompt + output;
    `eos` is recorded in the params the way the engine's input processor does."""
    n = len(params)
    prompts = prompts or [[] for _ in range(n)]
    outputs = outputs or [[] for _ in range(n)]
    if eos is not None:
        params = [p.clone() for p in params]
        for p in params:
            p.update_from_tokenizer(eos)
    return SamplingMetadata.from_params(
        params, [a + b for a, b in zip(prompts, outputs, strict=True)],
        [len(a) for a in prompts], vocab, indices=indices,
    )


def rand_logits(n, vocab=V, seed=0):
    return torch.randn(n, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax_with_lowest_index_ties():
    logits = rand_logits(6)
    logits[0, 5] = logits[0, 9] = 100.0  # tie: lowest index wins, like torch.argmax / HF
    out = sampler(logits, batch([SamplingParams(temperature=0.0)] * 6))
    assert out.sampled_token_ids == logits.argmax(-1).tolist()
    assert out.sampled_token_ids[0] == 5
    assert out.logprobs == [None] * 6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 2])
def test_row_argmax_equals_torch_argmax_on_ties_infs_and_nans(dtype, threads):
    """row_argmax (max(dim=-1)) picks the same index as Tensor.argmax: the first of tied
    maxima, a row of -inf gives 0, a NaN wins; at a vocabulary's width, as the kernels split
    the row into vector lanes and threads."""
    g = torch.Generator().manual_seed(3)
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for trial in range(40):
            rows = 1 + trial % 9 * 8
            vocab = [1, 17, 4099, 49152][trial % 4]
            x = torch.randint(-2, 2, (rows, vocab), generator=g).to(dtype)  # many ties
            if trial % 3 == 0:
                x[:, torch.randint(0, vocab, (vocab // 2,), generator=g)] = float("-inf")
            if trial % 5 == 0:
                x[0] = float("-inf")
            if trial % 7 == 0:
                x[-1, vocab // 3] = float("nan")
            assert torch.equal(row_argmax(x), x.argmax(dim=-1)), (trial, rows, vocab)
    finally:
        torch.set_num_threads(saved)


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.7, top_k=5, top_p=0.9, repetition_penalty=1.3),
    SamplingParams(temperature=0.7, top_k=5, top_p=0.9, min_p=0.1),  # read-only: no copy
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.0, logit_bias={3: 5.0}),
    SamplingParams(temperature=0.0, allowed_token_ids=[1, 4, 9]),
    SamplingParams(temperature=0.9, min_tokens=4, stop_token_ids=[2]),
], ids=["penalties", "top-k-p-min-p", "greedy", "bias", "allowed", "min-tokens-ban"])
def test_input_logits_not_modified(params):
    """The sampler copies the logits only where a step works in place; either way the
    caller's logits are untouched."""
    logits = rand_logits(3)
    before = logits.clone()
    sampler(logits, batch([params] * 3, outputs=[[1, 2], [3], []], eos=2))
    assert torch.equal(logits, before)


def test_top_k_one_and_tiny_top_p_and_min_p_one_equal_greedy():
    logits = rand_logits(8)
    expected = logits.argmax(-1).tolist()
    for params in (
        SamplingParams(temperature=1.3, top_k=1),
        SamplingParams(temperature=0.8, top_p=1e-6),
        SamplingParams(temperature=2.0, min_p=1.0),
    ):
        for _ in range(3):
            assert sampler(logits, batch([params] * 8)).sampled_token_ids == expected


def test_mixed_greedy_and_random_rows():
    logits = rand_logits(4)
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, top_k=1),
        SamplingParams(temperature=0.0, seed=1),
        SamplingParams(temperature=1.0, seed=1),
    ]
    out = sampler(logits, batch(params)).sampled_token_ids
    argmax = logits.argmax(-1).tolist()
    assert out[:3] == argmax[:3]
    assert 0 <= out[3] < V


def test_top_k_top_p_masks():
    logits = torch.tensor([[1.0, 4.0, 3.0, 2.0, 0.0]])
    masked = apply_top_k_top_p(logits.clone(), torch.tensor([2]), None)
    assert torch.isfinite(masked).tolist() == [[False, True, True, False, False]]
    probs = logits.softmax(-1)[0].sort(descending=True).values
    # top_p just above the top token's mass keeps exactly two tokens
    p = float(probs[0]) + 1e-3
    masked = apply_top_k_top_p(logits.clone(), None, torch.tensor([p]))
    assert torch.isfinite(masked).sum().item() == 2
    masked = apply_top_k_top_p(logits.clone(), None, torch.tensor([1.0]))
    assert torch.isfinite(masked).all()


def test_min_p_masks_relative_to_top_probability():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    masked = apply_min_p(logits.clone(), torch.tensor([0.2]))  # threshold 0.1
    assert torch.isfinite(masked).tolist() == [[True, True, True, False]]
    # sampling never picks a masked token
    params = [SamplingParams(min_p=0.2, seed=s) for s in range(200)]
    out = sampler(logits.expand(200, 4), batch(params, vocab=4)).sampled_token_ids
    assert 3 not in out and set(out) == {0, 1, 2}


def naive_penalties(logits, prompts, outputs, pres, freq, rep):
    out = logits.clone()
    for r in range(out.shape[0]):
        seen = set(prompts[r]) | set(outputs[r])
        for t in seen:
            x = out[r, t].item()
            out[r, t] = x / rep[r] if x > 0 else x * rep[r]
        for t in set(outputs[r]):
            out[r, t] -= freq[r] * outputs[r].count(t) + pres[r]
    return out


def test_penalties_match_naive_reference():
    from octavo.model.sample.sampler import apply_penalties

    gen = torch.Generator().manual_seed(7)
    n, vocab = 5, 20
    logits = torch.randn(n, vocab, generator=gen) * 2
    prompts = [torch.randint(0, vocab, (int(k),), generator=gen).tolist() for k in (0, 3, 7, 1, 9)]
    outputs = [torch.randint(0, vocab, (int(k),), generator=gen).tolist() for k in (4, 0, 6, 2, 11)]
    pres = [0.5, -1.0, 0.0, 2.0, 0.3]
    freq = [0.2, 0.0, -0.7, 1.5, 0.1]
    rep = [1.3, 0.8, 1.0, 2.0, 1.1]
    params = [
        SamplingParams(presence_penalty=p, frequency_penalty=f, repetition_penalty=r)
        for p, f, r in zip(pres, freq, rep, strict=True)
    ]
    b = batch(params, prompts, outputs, vocab=vocab)
    got = apply_penalties(logits.clone(), b)
    want = naive_penalties(logits, prompts, outputs, pres, freq, rep)
    torch.testing.assert_close(got, want)
    # greedy rows take the argmax of the penalised logits
    greedy = [SamplingParams(temperature=0, **vars_of(p)) for p in params]
    out = sampler(logits, batch(greedy, prompts, outputs, vocab=vocab))
    assert out.sampled_token_ids == want.argmax(-1).tolist()


def vars_of(p):
    return {
        "presence_penalty": p.presence_penalty,
        "frequency_penalty": p.frequency_penalty,
        "repetition_penalty": p.repetition_penalty,
    }


def test_seeded_rows_reproducible_and_batch_independent():
    logits = rand_logits(6, vocab=1000, seed=3)
    target = SamplingParams(temperature=1.5, top_p=0.95, seed=1234)
    other = [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.9, seed=99, top_k=20),
        SamplingParams(temperature=2.0),
        SamplingParams(temperature=1.0, seed=5),
    ]

    def alone(steps_done):
        b = batch([target], outputs=[[0] * steps_done], vocab=1000)
        return sampler(logits[2:3], b).sampled_token_ids[0]

    for steps_done in range(4):
        solo = alone(steps_done)
        assert solo == alone(steps_done)
        params = other[:2] + [target] + other[2:]
        outputs = [[1] * 3, [], [0] * steps_done, [2], [], [5] * 9]
        mixed = sampler(logits, batch(params, outputs=outputs, vocab=1000)).sampled_token_ids
        assert mixed[2] == solo
    # the stateless (seed, step) streams differ from step to step
    assert len({alone(s) for s in range(20)}) > 1


def test_parallel_samples_of_one_seed_draw_distinct_streams():
    """n samples of one seeded request differ by output index: same seed, same position,
    different draws; the same (seed, index, position) always draws the same."""
    logits = rand_logits(1, vocab=500, seed=4).expand(8, 500)
    params = [SamplingParams(temperature=1.0, seed=42)] * 8
    first = sampler(logits, batch(params, indices=list(range(8)), vocab=500)).sampled_token_ids
    again = sampler(logits, batch(params, indices=list(range(8)), vocab=500)).sampled_token_ids
    assert first == again
    assert len(set(first)) > 1


def test_sampling_matches_distribution():
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    logits = probs.log().expand(4000, 4)
    torch.manual_seed(0)
    out = sampler(logits, batch([SamplingParams()] * 4000, vocab=4)).sampled_token_ids
    freq = torch.bincount(torch.tensor(out), minlength=4).float() / 4000
    assert torch.allclose(freq, probs, atol=0.03)
    # temperature sharpens the distribution
    out = sampler(logits, batch([SamplingParams(temperature=0.25)] * 4000, vocab=4))
    assert out.sampled_token_ids.count(3) / 4000 > 0.6


def test_logprobs_are_raw_log_softmax_with_sorted_top_k():
    logits = rand_logits(3, vocab=V, seed=5)
    params = [
        SamplingParams(temperature=0.5, logprobs=5, repetition_penalty=1.5, seed=1),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0, logprobs=0, presence_penalty=1.0),
    ]
    out = sampler(logits, batch(params, outputs=[[1, 2], [], [3]]))
    assert out.logprobs[1] is None
    ref = logits.log_softmax(-1)
    row = out.logprobs[0]
    tok = out.sampled_token_ids[0]
    assert tok in row
    top = [t for t in row if row[t].rank is not None and row[t].rank <= 5][:5]
    assert top == ref[0].topk(5).indices.tolist()
    values = [row[t].logprob for t in top]
    assert values == sorted(values, reverse=True)
    assert [row[t].rank for t in top] == [1, 2, 3, 4, 5]
    for t, lp in row.items():
        assert math.isclose(lp.logprob, ref[0, t].item(), abs_tol=1e-5)
    expected_rank = int((ref[0] > ref[0, tok]).sum()) + 1
    assert row[tok].rank == expected_rank
    assert len(row) == (5 if expected_rank <= 5 else 6)
    # logprobs=0: only the sampled token
    row2 = out.logprobs[2]
    assert list(row2) == [out.sampled_token_ids[2]]


def test_compute_logprobs_for_prompt_positions():
    logits = rand_logits(4, seed=9)
    targets = [3, 1, 4, 1]
    entries = compute_logprobs(logits, targets, 2)
    ref = logits.log_softmax(-1)
    for r, entry in enumerate(entries):
        assert math.isclose(entry[targets[r]].logprob, ref[r, targets[r]].item(), abs_tol=1e-5)
        assert list(entry)[:2] == ref[r].topk(2).indices.tolist()


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_min_tokens_bans_eos_and_stop_ids(temperature):
    eos = 7
    logits = torch.zeros(2, V)
    logits[:, eos] = 50.0
    logits[:, 9] = 49.0
    logits[:, 11] = 10.0
    params = [
        SamplingParams(temperature=temperature, min_tokens=3, stop_token_ids=[9]),
        SamplingParams(temperature=temperature, min_tokens=3, stop_token_ids=[9]),
    ]
    b = batch(params, outputs=[[1, 2], [1, 2, 3]], eos=eos)
    assert b.banned_token_ids == [[7, 9], []]
    for _ in range(5):
        out = sampler(logits, b).sampled_token_ids
        assert out[0] == 11 and out[1] == eos
    # ignore_eos leaves EOS alone for min_tokens (only stop ids are banned)
    p = SamplingParams(min_tokens=3, stop_token_ids=[9], ignore_eos=True)
    assert batch([p], eos=eos).banned_token_ids == [[9]]


def test_large_vocab_batch_is_fast():
    import time

    n, vocab = 64, 49152
    logits = torch.randn(n, vocab)
    params = [
        SamplingParams(
            temperature=0.8, top_p=0.9, top_k=50, min_p=0.05, repetition_penalty=1.1, seed=i
        )
        for i in range(n)
    ]
    prompts = [list(range(i, i + 300)) for i in range(n)]
    outputs = [list(range(100)) for _ in range(n)]
    start = time.perf_counter()
    b = SamplingMetadata.from_params(params, [p + o for p, o in zip(prompts, outputs, strict=True)],
                                     [len(p) for p in prompts], vocab)
    out = sampler(logits, b)
    assert len(out.sampled_token_ids) == n
    assert time.perf_counter() - start < 5.0


def test_logit_bias_is_added_before_everything_else():
    logits = torch.zeros(3, V)
    logits[:, 5] = 10.0
    params = [SamplingParams(temperature=0, logit_bias={9: 11.0}),  # 9 now wins
              SamplingParams(temperature=0, logit_bias={5: -100.0}, seed=1),  # 5 is banned
              SamplingParams(temperature=0)]
    out = sampler(logits, batch(params)).sampled_token_ids
    assert out[0] == 9 and out[1] != 5 and out[2] == 5
    with pytest.raises(ValueError, match=r"logit_bias values must be in \[-100, 100\]"):
        SamplingParams(logit_bias={1: 101.0})
    with pytest.raises(ValueError, match="logit_bias token id must be non-negative"):
        SamplingParams(logit_bias={-1: 1.0})
