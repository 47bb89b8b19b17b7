"""Decodes first, and prompts held to their share of a step: a long prefill never takes the
budget a running stream's next token needs (time per output token), `long_prefill_token_threshold`
caps one prompt's chunk, `max_num_partial_prefills` the prompts per step; greedy outputs do not
change with either."""

from __future__ import annotations

import pytest

from octavo import LLM, SamplingParams
from tests.engine.test_scheduler_plan import make, request, run


def chunk_sizes(plan) -> dict[int, int]:
    return {c.seq_id: len(c.token_ids) for c in plan.chunks}


def test_a_running_prompt_never_takes_a_decodes_token():
    sched = make(num_blocks=64, max_num_batched_tokens=8)
    a = request("a", list(range(10, 14)), max_tokens=20)  # ranks first, decodes
    sched.add_request(a)
    run(sched)
    # b was preempted and must recompute its 30 tokens: as a running prompt it ranks after a
    b = request("b", list(range(100, 130)), max_tokens=4)
    sched.add_request(b)
    run(sched)  # a decodes (1), b gets the other 7 of 8
    for _ in range(4):
        plan, _ = run(sched)
        sizes = chunk_sizes(plan)
        assert sizes[a.seqs[0].seq_id] == 1  # a's token every step
        assert sum(sizes.values()) <= 8


def test_decodes_come_before_a_higher_ranked_prompt():
    """Under the priority policy a prompt that outranks a running stream is admitted first,
    but once both run, the stream's decode is scheduled before every prompt chunk: the prompt
    takes what the budget has left, it does not starve the stream."""
    sched = make(num_blocks=64, max_num_batched_tokens=6, scheduling_policy="priority")
    stream = request("stream", [1, 2], max_tokens=20)
    stream.priority = 10
    sched.add_request(stream)
    run(sched)
    run(sched)
    urgent = request("urgent", list(range(10, 40)), max_tokens=2)  # 30 prompt tokens
    urgent.priority = 0
    sched.add_request(urgent)
    run(sched)  # urgent is admitted ahead of the stream (it outranks it): 6 of its 30 tokens
    urgent_chunks = []
    for _ in range(5):
        sizes = chunk_sizes(run(sched)[0])
        assert sizes[stream.seqs[0].seq_id] == 1
        urgent_chunks.append(sizes[urgent.seqs[0].seq_id])
    assert urgent_chunks == [5, 5, 5, 5, 4]  # the rest of the budget, until its prompt ends


def test_long_prefill_token_threshold_caps_a_prompts_chunk():
    sched = make(num_blocks=64, max_num_batched_tokens=64, long_prefill_token_threshold=5)
    r = request("r", list(range(10, 32)))  # 22 tokens: 5 + 5 + 5 + 5 + 2
    sched.add_request(r)
    sizes = [chunk_sizes(run(sched)[0])[r.seqs[0].seq_id] for _ in range(6)]
    assert sizes == [5, 5, 5, 5, 2, 1]


def test_max_num_partial_prefills_admits_one_prompt_per_step():
    sched = make(num_blocks=64, max_num_batched_tokens=64, max_num_partial_prefills=1)
    reqs = [request(f"r{i}", list(range(10 * i, 10 * i + 6)), max_tokens=3) for i in range(3)]
    for r in reqs:
        sched.add_request(r)
    prompts_per_step = []
    for _ in range(4):
        plan, _ = run(sched)
        prompts_per_step.append(sum(len(c.token_ids) > 1 for c in plan.chunks))
    assert prompts_per_step == [1, 1, 1, 0]
    unlimited = make(num_blocks=64, max_num_batched_tokens=64)
    for r in [request(f"u{i}", list(range(10 * i, 10 * i + 6)), max_tokens=3) for i in range(3)]:
        unlimited.add_request(r)
    plan, _ = run(unlimited)
    assert sum(len(c.token_ids) > 1 for c in plan.chunks) == 3


@pytest.mark.parametrize("limits", [dict(long_prefill_token_threshold=7),
                                    dict(max_num_partial_prefills=1),
                                    dict(long_prefill_token_threshold=3,
                                         max_num_partial_prefills=2)])
def test_greedy_outputs_do_not_change(tiny_llama_dir, limits):
    prompts = [{"prompt_token_ids": list(range(5 + i, 5 + i + 20 + 7 * i))} for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    want = LLM(str(tiny_llama_dir), num_kv_blocks=64).generate(prompts, params, use_tqdm=False)
    llm = LLM(str(tiny_llama_dir), num_kv_blocks=64, max_num_batched_tokens=16, **limits)
    got = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert llm.stats()["kv_blocks_used"] == 0
