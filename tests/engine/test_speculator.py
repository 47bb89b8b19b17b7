"""Speculative decoding's pure parts: the n-gram proposer, draft acceptance, the cost model and
the config."""

from __future__ import annotations

import pytest

from octavo.config import SpeculativeConfig
from octavo.engine.ngram_proposer import propose_ngram
from octavo.engine.speculator import (
    DraftState,
    Speculator,
    StepCostModel,
    best_num_drafts,
    expected_tokens,
)
from octavo.engine_args import EngineArgsError, from_kwargs, to_cli_flags
from octavo.model.spec.draft_acceptance import accept_drafts


# -- n-gram proposer ---------------------------------------------------------------------------
def test_ngram_proposes_what_followed_the_latest_earlier_occurrence():
    tokens = [1, 2, 3, 7, 1, 2, 3, 8, 9, 1, 2, 3]
    assert propose_ngram(tokens, 2, 1, 3) == [8, 9]  # the latest earlier (1, 2, 3)
    # past the end of the tokens the copy runs on into itself: the pattern repeats
    assert propose_ngram(tokens, 7, 3, 3) == [8, 9, 1, 2, 3, 8, 9]


def test_ngram_prefers_the_longest_match():
    # the last token 5 last occurred before 6; the last two (4, 5) only before 7
    tokens = [4, 5, 7, 0, 5, 6, 4, 5]
    assert propose_ngram(tokens, 1, 1, 2) == [7]
    assert propose_ngram(tokens, 1, 1, 1) == [6]


def test_ngram_returns_nothing_without_a_match_or_room():
    assert propose_ngram([1, 2, 3, 4], 3, 1, 3) == []
    assert propose_ngram([1, 2, 1, 2], 0, 1, 3) == []
    assert propose_ngram([1], 3, 1, 3) == []
    assert propose_ngram([1, 2, 3, 1, 2], 3, 3, 4) == []  # (3, 1, 2) never occurred before


def test_ngram_continues_a_repeating_pattern():
    assert propose_ngram([5, 5, 5, 5], 3, 1, 2) == [5, 5, 5]
    assert propose_ngram([0, 1, 2, 1, 2], 5, 1, 2) == [1, 2, 1, 2, 1]


# -- acceptance --------------------------------------------------------------------------------
@pytest.mark.parametrize("drafts,samples,kept", [
    ([4, 5, 6], [4, 5, 6, 7], [4, 5, 6, 7]),  # all accepted, plus the bonus sample
    ([4, 5, 6], [4, 9, 6, 7], [4, 9]),  # rejected at 5: the sample there replaces it
    ([4, 5, 6], [1, 5, 6, 7], [1]),  # the first draft rejected
    ([], [3], [3]),
])
def test_accept_drafts(drafts, samples, kept):
    assert accept_drafts(drafts, samples) == kept


def test_accept_drafts_needs_one_sample_per_position():
    with pytest.raises(ValueError, match="3 samples for 3 drafts"):
        accept_drafts([1, 2, 3], [1, 2, 3])


# -- cost model --------------------------------------------------------------------------------
def test_expected_tokens_is_the_geometric_sum():
    assert expected_tokens(0.5, 0) == 1
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)
    assert expected_tokens(1.0, 4) == 5


def test_best_num_drafts_follows_acceptance_and_cost():
    assert best_num_drafts(0.9, 5, 0.05) == 5  # cheap, usually right: all of them
    assert best_num_drafts(0.02, 5, 0.05) == 0  # rarely right: none
    assert best_num_drafts(0.9, 5, 1.0) == 0  # a full batch: a draft token costs a token
    mid = best_num_drafts(0.5, 8, 0.05)
    assert 1 <= mid < 8  # later drafts are worth less than they cost


def test_step_cost_model_fits_base_and_per_token_time():
    cost = StepCostModel()
    for tokens in [1, 3, 5, 2, 6, 1, 4] * 5:
        cost.observe(tokens, 1, 0.020 + 0.002 * tokens)
    base, per_token = cost.fit()
    assert base == pytest.approx(0.020, rel=1e-6)
    assert per_token == pytest.approx(0.002, rel=1e-6)
    # the last step had 4 tokens and one sampling sequence: a draft token costs the batch
    # 0.002 s of a 0.028 s step that yields one token
    assert cost.draft_token_cost() == pytest.approx(0.002 / 0.028)


def test_step_cost_model_uses_the_prior_until_token_counts_vary():
    cost = StepCostModel()
    for _ in range(10):
        cost.observe(1, 1, 0.021)
    base, per_token = cost.fit()
    assert base + per_token == pytest.approx(0.021)
    assert 0 < per_token < base


def test_speculator_turns_off_and_back_on_with_acceptance():
    config = SpeculativeConfig("ngram", 4, 1, 2)
    spec = Speculator(config, max_model_len=1000)
    for tokens, seconds in [(1, 0.020), (5, 0.028)] * 4:  # a draft token: 10% of a step
        spec.cost.observe(tokens, 1, seconds)
    state = DraftState()
    tokens = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2]
    # prior alpha 0.5: a third draft token still gains 0.125 - 0.07, a fourth would not
    assert spec.propose(state, tokens, room=10) == ([3, 4, 1], 3)
    for _ in range(15):  # every draft rejected
        spec.record(state, 4, [9])
    assert spec.propose(state, tokens, room=10)[0] == []
    assert state.shadow == 3  # what it would have proposed first
    for _ in range(8):  # it would have been right each time
        spec.propose(state, tokens, room=10)
        spec.record(state, 0, [3])
    assert spec.propose(state, tokens, room=10)[0] != []
    stats = spec.stats.as_stats()
    assert stats["spec_decode_num_drafts"] == 15
    assert stats["spec_decode_num_draft_tokens"] == 60
    assert stats["spec_decode_num_accepted_tokens"] == 0
    assert stats["spec_decode_num_accepted_tokens_per_pos_3"] == 0


def test_speculator_counts_accepted_tokens_by_position():
    spec = Speculator(SpeculativeConfig("ngram", 3, 1, 1, cost_model=False), 1000)
    state = DraftState()
    spec.record(state, 3, [5, 6, 7, 8])  # all 3 accepted
    spec.record(state, 3, [5, 0])  # the first accepted
    s = spec.stats.as_stats()
    assert s["spec_decode_num_accepted_tokens"] == 4
    assert [s[f"spec_decode_num_accepted_tokens_per_pos_{i}"] for i in range(3)] == [2, 1, 1]


def test_speculator_respects_room_and_max_model_len():
    spec = Speculator(SpeculativeConfig("ngram", 4, 1, 1, cost_model=False), max_model_len=11)
    tokens = [1, 2, 3, 4, 5, 6, 7, 1]
    assert spec.propose(DraftState(), tokens, room=2) == ([2, 3], 2)
    assert spec.propose(DraftState(), tokens, room=10) == ([2, 3, 4], 3)  # positions 8..10
    assert spec.propose(DraftState(), tokens, room=0) == ([], 0)


def test_a_drafting_model_gets_a_number_of_drafts_and_probes_when_off():
    config = SpeculativeConfig("self_draft", 4, cost_model=True, num_draft_layers=2)
    spec = Speculator(config, max_model_len=1000)
    spec.draft_token_share = 0.25
    state = DraftState()
    # alpha 0.5, a draft token costing 0.25 + 0.05: one draft gains 0.2, a second would not
    assert spec.propose(state, [1, 2, 3], room=10) == ([], 1)
    for _ in range(30):
        spec.record(state, 2, [9])  # always rejected
    ks = [spec.propose(state, [1, 2, 3], room=10)[1] for _ in range(16 + 32 + 64)]
    # off, but probed after 16 steps, then 32, then 64 (the probes' drafts keep failing)
    assert [i for i, k in enumerate(ks) if k] == [15, 47, 111]


# -- config --------------------------------------------------------------------------------------
def test_config_follows_vllm_defaults():
    c = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (5, 5)
    c = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3,
                                     "prompt_lookup_max": 4})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (4, 4)
    c = SpeculativeConfig.from_dict({"model": "[ngram]", "num_speculative_tokens": 2,
                                     "prompt_lookup_min": 1, "prompt_lookup_max": 3})
    assert (c.method, c.prompt_lookup_min, c.prompt_lookup_max) == ("ngram", 1, 3)


@pytest.mark.parametrize("config,problem", [
    ({"num_speculative_tokens": 3}, "'method' must be given"),
    ({"method": "ngram"}, "'num_speculative_tokens' must be an int >= 1"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "must be an int >= 1"),
    ({"method": "eagle", "num_speculative_tokens": 3}, "method 'eagle' is not supported"),
    ({"method": "draft_model", "num_speculative_tokens": 3}, "needs 'model'"),
    ({"method": "ngram", "num_speculative_tokens": 3, "num_draft_layers": 2},
     "'num_draft_layers' is for method 'self_draft'"),
    ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 4,
      "prompt_lookup_max": 2}, "must be <= 'prompt_lookup_max'"),
    ({"method": "ngram", "num_speculative_tokens": 3, "lookup": 2}, "unknown key 'lookup'"),
])
def test_bad_configs_name_the_problem(config, problem):
    with pytest.raises(EngineArgsError, match="speculative_config") as e:
        from_kwargs(speculative_config=config)
    assert problem in str(e.value)


def test_config_travels_as_json_on_the_command_line():
    config = {"method": "ngram", "num_speculative_tokens": 3}
    flags = to_cli_flags({"speculative_config": config})
    assert flags == ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}']


def test_speculation_with_custom_logits_processors_is_refused():
    with pytest.raises(EngineArgsError, match="logits_processors"):
        from_kwargs(speculative_config={"method": "ngram", "num_speculative_tokens": 2},
                    logits_processors=("pkg.mod:Proc",))


def test_speculative_config_flag_parses_json():
    import argparse

    from octavo.engine_args import add_cli_args, from_cli_args

    parser = argparse.ArgumentParser(exit_on_error=False)
    add_cli_args(parser)
    ns = parser.parse_args(["--speculative-config",
                            '{"method": "ngram", "num_speculative_tokens": 2}'])
    args = from_cli_args(ns)
    assert args.speculative_config == {"method": "ngram", "num_speculative_tokens": 2}
    with pytest.raises(argparse.ArgumentError, match="not JSON"):
        parser.parse_args(["--speculative-config", "{method: ngram}"])
    with pytest.raises(EngineArgsError, match="--speculative-config: method 'x'"):
        from_cli_args(parser.parse_args(["--speculative-config",
                                         '{"method": "x", "num_speculative_tokens": 2}']))
