"""A forked request (n > 1) preempted by recompute comes back with all its sequences. With a
token budget smaller than its sequences' tokens it still makes progress (the later sequences
catch up in later steps), and no block enters the prefix cache without its KV being computed.
(Regression: re-admission used to need every sequence scheduled in one step, and on failure
freed sequences whose new full blocks were already registered in the prefix cache.)"""

from __future__ import annotations

import pytest

from octavo import LLM, SamplingParams
from tests.engine.conftest import tokens_prompt

A = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
X = SamplingParams(n=2, temperature=1.0, seed=1, max_tokens=40, ignore_eos=True)
PA = [5 + i for i in range(8)]
PX = [100 + i for i in range(10)]


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), block_size=16, num_kv_blocks=64, max_model_len=64,
              enable_prefix_caching=False)
    outs = llm.generate([tokens_prompt(PA), tokens_prompt(PX)], [A, X], use_tqdm=False)
    return {rid: [c.token_ids for c in o.outputs] for rid, o in zip("ax", outs, strict=True)}


@pytest.mark.parametrize("num_blocks", [9, 12])
@pytest.mark.parametrize("caching", [False, True], ids=["nocache", "cache"])
def test_forked_request_recomputed_after_preemption(tiny_llama_dir, reference, caching,
                                                    num_blocks):
    llm = LLM(str(tiny_llama_dir), block_size=8, num_kv_blocks=num_blocks, max_model_len=64,
              max_num_batched_tokens=16, enable_prefix_caching=caching,
              preemption_mode="recompute")
    engine = llm.engine
    engine.add_request("a", tokens_prompt(PA), A)
    engine.add_request("x", tokens_prompt(PX), X)
    outs = {}
    for _ in range(500):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out
        engine.check_invariants()
    assert not engine.has_unfinished_requests(), "the preempted forked request never came back"
    assert engine.stats()["num_preemptions"] > 0
    for rid in "ax":
        assert [c.token_ids for c in outs[rid].outputs] == reference[rid], rid
    assert engine.stats()["kv_blocks_used"] == 0
