"""A request whose parallel samples together outgrow the KV cache still completes (its
sequences take turns) instead of livelocking, and a failed step leaves no uncomputed block
findable in the prefix cache."""

from __future__ import annotations

import pytest

from octavo import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(model=str(tiny_llama_dir), num_kv_blocks=40, block_size=16, max_model_len=512)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_parallel_samples_outgrowing_the_cache_complete(tiny_llama_dir, mode):
    # 4 samples x 490 tokens need 4 x 31 blocks; the cache has 40
    llm = LLM(model=str(tiny_llama_dir), num_kv_blocks=40, block_size=16, max_model_len=512,
              preemption_mode=mode)
    engine = llm.engine
    engine.add_request("big", {"prompt_token_ids": [5] * 10},
                       SamplingParams(n=4, max_tokens=480, ignore_eos=True))
    engine.add_request("small", {"prompt_token_ids": [7] * 10},
                       SamplingParams(max_tokens=8, ignore_eos=True))
    finished = {}
    for _ in range(3000):
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        engine.check_invariants()
        if not engine.has_unfinished_requests():
            break
    assert not engine.has_unfinished_requests(), "the engine livelocked"
    assert [len(o.token_ids) for o in finished["big"].outputs] == [480] * 4
    assert len(finished["small"].outputs[0].token_ids) == 8
    assert engine.stats()["kv_blocks_used"] == 0


def test_failed_step_leaves_no_uncomputed_cache_entry(llm, monkeypatch):
    prompt = {"prompt_token_ids": list(range(3, 3 + 64))}
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    expected = LLM(model=llm.engine.model_dir.as_posix(), num_kv_blocks=40, max_model_len=512,
                   enable_prefix_caching=False).generate(prompt, params, use_tqdm=False)
    real = llm.engine.runner.execute

    def fail(plan):
        raise RuntimeError("injected failure before any KV was written")

    monkeypatch.setattr(llm.engine.runner, "execute", fail)
    with pytest.raises(RuntimeError, match="injected"):
        llm.generate(prompt, params, use_tqdm=False)
    monkeypatch.setattr(llm.engine.runner, "execute", real)
    again = llm.generate(prompt, params, use_tqdm=False)[0]
    assert llm.stats()["prefix_cache_hit_tokens"] == 0  # nothing uncomputed was hit
    assert again.outputs[0].token_ids == expected[0].outputs[0].token_ids
    assert llm.stats()["kv_blocks_used"] == 0
