"""Bad input gets a clear error naming the problem, and no KV block is leaked."""

from __future__ import annotations

import json

import pytest

from octavo import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(model=str(tiny_llama_dir), max_model_len=64, num_kv_blocks=32)


def assert_no_blocks_in_use(llm: LLM) -> None:
    stats = llm.stats()
    assert stats["kv_blocks_used"] == 0
    assert stats["num_requests_running"] == stats["num_requests_waiting"] == 0


def test_empty_prompt(llm):
    with pytest.raises(ValueError, match="empty"):
        llm.generate({"prompt_token_ids": []}, use_tqdm=False)
    assert_no_blocks_in_use(llm)


def test_prompt_longer_than_max_model_len(llm):
    good = {"prompt_token_ids": [5, 6, 7]}
    with pytest.raises(ValueError, match=r"70 tokens.*max_model_len is 64"):
        # the first prompt was already queued when the second one failed: it is taken back
        llm.generate([good, {"prompt_token_ids": [5] * 70}], use_tqdm=False)
    assert_no_blocks_in_use(llm)


def test_token_id_out_of_vocab(llm):
    with pytest.raises(ValueError, match="out of range"):
        llm.generate({"prompt_token_ids": [1, 999999]}, use_tqdm=False)
    assert_no_blocks_in_use(llm)


def test_bad_sampling_params():
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)


def test_engine_failure_mid_run_returns_blocks(llm, monkeypatch):
    calls = {"n": 0}
    real = llm.engine.runner.execute

    def failing(plan):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected failure")
        return real(plan)

    monkeypatch.setattr(llm.engine.runner, "execute", failing)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    with pytest.raises(RuntimeError, match="injected"):
        llm.generate([{"prompt_token_ids": [3, 4, 5]}] * 4, params, use_tqdm=False)
    assert_no_blocks_in_use(llm)
    monkeypatch.undo()
    out = llm.generate({"prompt_token_ids": [3, 4, 5]}, params, use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 10


def test_model_path_does_not_exist(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        LLM(model=str(tmp_path / "nope"))


def test_model_path_not_a_llama(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(ValueError, match="unsupported model_type 'bert'"):
        LLM(model=str(tmp_path))


def test_model_dir_without_config(tmp_path):
    with pytest.raises(ValueError, match="no config.json"):
        LLM(model=str(tmp_path))


def test_unsupported_dtype(tiny_llama_dir):
    with pytest.raises(ValueError, match="dtype: 'int8' is not one of auto, float32, bfloat16"):
        LLM(model=str(tiny_llama_dir), dtype="int8")


def test_unsupported_block_size(tiny_llama_dir):
    with pytest.raises(ValueError, match="block_size: 12 is not one of 1, 8, 16"):
        LLM(model=str(tiny_llama_dir), block_size=12)


def test_max_model_len_larger_than_cache(tiny_llama_dir):
    with pytest.raises(ValueError, match="do not fit in the KV cache"):
        LLM(model=str(tiny_llama_dir), max_model_len=256, num_kv_blocks=4)
