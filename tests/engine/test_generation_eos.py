"""Every EOS id of the model stops a request (vLLM's update_from_generation_config).

A model may list several EOS ids in config.json (Gemma 3: [1, 106], 106 = <end_of_turn>). The
tokenizer's EOS stays the EOS (stop_reason None); the others join stop_token_ids, so they stop a
request with finish_reason "stop" and stop_reason the id, as vLLM reports them. min_tokens holds
all of them back; ignore_eos turns all of them off. On the tiny random Llama with eos_token_id
[2, 7, 9] (the tokenizer's EOS is 2); logit_bias forces the token to test.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from octavo import LLM, SamplingParams
from tests.conftest import build_tiny_llama
from tests.engine.conftest import tokens_prompt

EOS_IDS = [2, 7, 9]
PROMPT = tokens_prompt([5, 17, 42, 99, 3, 120])


@pytest.fixture(scope="module")
def multi_eos_dir(tmp_path_factory) -> Path:
    path = build_tiny_llama(tmp_path_factory.mktemp("tiny-multi-eos"), eos_token_id=EOS_IDS)
    assert json.loads((path / "config.json").read_text())["eos_token_id"] == EOS_IDS
    return path


@pytest.fixture(scope="module")
def llm(multi_eos_dir) -> LLM:
    return LLM(model=str(multi_eos_dir), num_kv_blocks=64)


def run(llm: LLM, **params):
    out = llm.generate(PROMPT, SamplingParams(temperature=0, **params), use_tqdm=False)
    return out[0].outputs[0]


# --- SamplingParams alone ------------------------------------------------------------------


def test_the_other_eos_ids_become_stop_token_ids() -> None:
    p = SamplingParams()
    p.update_from_generation_config({"eos_token_id": EOS_IDS}, 2)
    assert p.stop_token_ids == [7, 9]
    assert p.all_stop_token_ids == {2, 7, 9}


def test_explicit_stop_token_ids_come_first_and_are_not_repeated() -> None:
    p = SamplingParams(stop_token_ids=[9, 5])
    p.update_from_generation_config({"eos_token_id": [2, 7, 9, 7]}, 2)
    assert p.stop_token_ids == [9, 5, 7]
    assert p.all_stop_token_ids == {2, 5, 7, 9}


def test_an_int_or_missing_eos_adds_nothing_but_the_tokenizer_eos() -> None:
    for config in ({"eos_token_id": 2}, {"eos_token_id": None}, {}, {"eos_token_id": []}):
        p = SamplingParams()
        p.update_from_generation_config(config, 2)
        assert p.stop_token_ids == [] and p.all_stop_token_ids == {2}, config


def test_without_a_tokenizer_eos_every_model_eos_is_a_stop_token_id() -> None:
    p = SamplingParams()
    p.update_from_generation_config({"eos_token_id": [1, 106]}, None)
    assert p.stop_token_ids == [1, 106] and p.all_stop_token_ids == {1, 106}


def test_ignore_eos_turns_them_all_off_but_keeps_explicit_stop_ids() -> None:
    p = SamplingParams(ignore_eos=True, stop_token_ids=[5])
    p.update_from_generation_config({"eos_token_id": EOS_IDS}, 2)
    assert p.stop_token_ids == [5] and p.all_stop_token_ids == {5}


# --- the engine ----------------------------------------------------------------------------


def test_the_engine_copy_gets_them_and_the_callers_params_do_not(llm) -> None:
    params = SamplingParams(stop_token_ids=[5])
    request = llm.engine.input_processor.process("r-eos", PROMPT, params)
    assert request.eos_token_id == 2
    assert request.params.stop_token_ids == [5, 7, 9]
    assert request.params.all_stop_token_ids == {2, 5, 7, 9}
    assert params.stop_token_ids == [5] and params.all_stop_token_ids == {5}


@pytest.mark.parametrize("token", [7, 9])
def test_another_eos_id_stops_with_its_id_as_stop_reason(llm, token) -> None:
    out = run(llm, max_tokens=8, logit_bias={token: 100.0})
    assert out.token_ids == [token]
    assert out.finish_reason == "stop" and out.stop_reason == token


def test_the_tokenizer_eos_still_stops_as_eos(llm) -> None:
    out = run(llm, max_tokens=8, logit_bias={2: 100.0})
    assert out.token_ids == [2]
    assert out.finish_reason == "stop" and out.stop_reason is None


def test_min_tokens_holds_back_every_eos_id(llm) -> None:
    # 7 is forced, the other two are next in line: the ban must cover all three
    bias = {7: 100.0, 9: 90.0, 2: 80.0}
    out = run(llm, max_tokens=8, min_tokens=3, logit_bias=bias)
    assert len(out.token_ids) == 4 and not set(out.token_ids[:3]) & set(EOS_IDS)
    assert out.token_ids[3] == 7
    assert out.finish_reason == "stop" and out.stop_reason == 7


def test_ignore_eos_runs_through_every_eos_id(llm) -> None:
    out = run(llm, max_tokens=5, ignore_eos=True, logit_bias={9: 100.0})
    assert out.token_ids == [9] * 5 and out.finish_reason == "length"
    out = run(llm, max_tokens=5, ignore_eos=True, logit_bias={2: 100.0})
    assert out.token_ids == [2] * 5 and out.finish_reason == "length"


def test_parallel_samples_each_stop_on_them(llm) -> None:
    params = SamplingParams(n=3, seed=1, max_tokens=8, logit_bias={9: 100.0})
    outs = llm.generate(PROMPT, params, use_tqdm=False)[0].outputs
    assert len(outs) == 3
    for o in outs:
        assert o.token_ids == [9] and o.finish_reason == "stop" and o.stop_reason == 9


def test_a_single_eos_model_is_unchanged(tiny_llama_dir) -> None:
    llm = LLM(model=str(tiny_llama_dir), num_kv_blocks=64)
    request = llm.engine.input_processor.process("r-one", PROMPT, SamplingParams())
    assert request.params.stop_token_ids == [] and request.params.all_stop_token_ids == {2}
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=6, logit_bias={7: 100}),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == [7] * 6 and out.finish_reason == "length"
