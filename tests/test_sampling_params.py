"""SamplingParams / BeamSearchParams: vLLM defaults, normalisation and validation messages."""

from __future__ import annotations

import pytest

from octavo.sampling_params import BeamSearchParams, SamplingParams


def test_defaults_match_vllm():
    p = SamplingParams()
    assert (p.n, p.best_of, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1, 1.0, 1.0, 0, 0.0)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert p.max_tokens == 16 and p.min_tokens == 0 and p.seed is None
    assert p.stop == [] and p.stop_token_ids == [] and not p.ignore_eos
    assert p.logprobs is None and p.prompt_logprobs is None
    assert p.skip_special_tokens and p.spaces_between_special_tokens and p.detokenize
    assert not p.include_stop_str_in_output
    assert not p.is_greedy


def test_normalisation_and_types():
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(temperature=0.0).is_greedy
    assert SamplingParams(temperature=1e-6).is_greedy
    assert not SamplingParams(seed=3).is_greedy
    assert SamplingParams(max_tokens=None).max_tokens is None
    p = SamplingParams(stop_token_ids=[5])
    p.update_from_tokenizer(2)
    assert p.all_stop_token_ids == {2, 5}
    q = SamplingParams(ignore_eos=True)
    q.update_from_tokenizer(2)
    assert q.all_stop_token_ids == set()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"n": 0}, "n must be at least 1"),
        ({"n": 2, "best_of": 1}, "best_of must be greater than or equal to n"),
        ({"presence_penalty": 2.5}, "presence_penalty must be in [-2, 2], got 2.5"),
        ({"presence_penalty": -2.1}, "presence_penalty must be in [-2, 2]"),
        ({"frequency_penalty": -3}, "frequency_penalty must be in [-2, 2], got -3"),
        ({"repetition_penalty": 0.0}, "repetition_penalty must be greater than zero, got 0.0"),
        ({"temperature": -1}, "temperature must be non-negative, got -1"),
        ({"top_p": 0.0}, "top_p must be in (0, 1], got 0.0"),
        ({"top_p": 1.5}, "top_p must be in (0, 1]"),
        ({"top_k": -2}, "top_k must be 0 or -1 (disable), or at least 1, got -2"),
        ({"top_k": 1.5}, "top_k must be an integer"),
        ({"min_p": 1.1}, "min_p must be in [0, 1], got 1.1"),
        ({"min_p": -0.1}, "min_p must be in [0, 1]"),
        ({"max_tokens": 0}, "max_tokens must be at least 1, got 0"),
        ({"min_tokens": -1}, "min_tokens must be greater than or equal to 0, got -1"),
        ({"min_tokens": 17}, "min_tokens must be less than or equal to max_tokens=16, got 17"),
        ({"logprobs": -1}, "logprobs must be non-negative, got -1"),
        ({"prompt_logprobs": -1}, "prompt_logprobs must be non-negative, got -1"),
        ({"stop": ["ok", ""]}, "stop cannot contain an empty string"),
        ({"stop": [1]}, "stop must be a string or a list of strings"),
        ({"seed": "x"}, "seed must be an integer"),
    ],
)
def test_validation_errors(kwargs, message):
    with pytest.raises(ValueError) as excinfo:
        SamplingParams(**kwargs)
    assert message in str(excinfo.value)


def test_edges_accepted():
    SamplingParams(presence_penalty=-2, frequency_penalty=2, top_p=1.0, min_p=1.0, top_k=1)
    SamplingParams(temperature=0.0, logprobs=0, prompt_logprobs=0, min_tokens=16)
    SamplingParams(max_tokens=None, min_tokens=1000)


def test_beam_search_params():
    b = BeamSearchParams(beam_width=4, max_tokens=8)
    assert (b.ignore_eos, b.temperature, b.length_penalty) == (False, 0.0, 1.0)
    assert not b.include_stop_str_in_output
    with pytest.raises(ValueError, match="beam_width must be at least 1, got 0"):
        BeamSearchParams(beam_width=0, max_tokens=8)
    with pytest.raises(ValueError, match="max_tokens must be at least 1, got 0"):
        BeamSearchParams(beam_width=2, max_tokens=0)
    with pytest.raises(ValueError, match="temperature must be non-negative"):
        BeamSearchParams(beam_width=2, max_tokens=4, temperature=-0.5)
