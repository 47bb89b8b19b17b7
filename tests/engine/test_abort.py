"""Aborting a request in any state (waiting, running mid-prefill, decoding, swapped out) gives
back all its blocks at once, and leaves the other requests untouched."""

from __future__ import annotations

import pytest

from octavo import LLM, SamplingParams
from octavo.engine.request import RequestStatus
from tests.engine.conftest import tokens_prompt

LONG = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


def prompt(seed: int, n: int) -> dict:
    return tokens_prompt([3 + (seed * 31 + i * 7) % 250 for i in range(n)])


def live_blocks(engine, exclude=None) -> tuple[set[int], int]:
    """GPU blocks held by the block tables of the live sequences of every request but
    `exclude`, and the number of those sequences that are swapped out."""
    blocks, swapped = set(), 0
    for req in list(engine.scheduler.running) + list(engine.scheduler.swapped):
        if req is exclude:
            continue
        for seq in req.live_seqs:
            if req.status is RequestStatus.SWAPPED:
                swapped += 1
            else:
                blocks.update(engine.kv.block_table(seq.seq_id))
    return blocks, swapped


def abort_and_check(engine, request) -> None:
    seq_ids = [s.seq_id for s in request.seqs]
    others, _ = live_blocks(engine, exclude=request)
    assert engine.abort_request(request.request_id)
    engine.check_invariants()
    for seq_id in seq_ids:
        with pytest.raises(KeyError):
            engine.kv.block_table(seq_id)
        assert seq_id not in engine.scheduler.seqs
    assert all(s.num_computed_tokens == 0 for s in request.seqs)
    stats = engine.stats()
    assert stats["kv_blocks_used"] == len(others)  # exactly the others' blocks remain
    if not engine.scheduler.swapped:
        assert stats["kv_cpu_blocks_used"] == 0
    assert request.status is RequestStatus.FINISHED
    assert all(s.finish_reason in ("abort", "length", "stop") for s in request.seqs)
    assert request not in engine.scheduler.waiting + engine.scheduler.running
    assert request not in engine.scheduler.swapped
    assert not engine.abort_request(request.request_id)  # unknown now


def drain(engine, aborted: set[str], steps: int = 500) -> dict:
    finished = {}
    for _ in range(steps):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            assert out.request_id not in aborted
            if out.finished:
                finished[out.request_id] = out
        engine.check_invariants()
    assert not engine.has_unfinished_requests()
    stats = engine.stats()
    assert stats["kv_blocks_used"] == 0 and stats["kv_cpu_blocks_used"] == 0
    return finished


@pytest.fixture(params=[False, True], ids=["nocache", "cache"])
def llm(request, tiny_llama_dir) -> LLM:
    return LLM(str(tiny_llama_dir), block_size=8, num_kv_blocks=16, max_model_len=128,
               max_num_batched_tokens=24, preemption_mode="swap",
               enable_prefix_caching=request.param)


def test_abort_waiting(llm):
    engine = llm.engine
    a = engine.add_request("a", prompt(1, 30), LONG)
    b = engine.add_request("b", prompt(2, 20), LONG)
    engine.step()  # a prefills its first chunk (the whole token budget), b waits
    assert a.status is RequestStatus.RUNNING and b.status is RequestStatus.WAITING
    abort_and_check(engine, b)
    assert set(drain(engine, {"b"})) == {"a"}


def test_abort_mid_prefill(llm):
    engine = llm.engine
    a = engine.add_request("a", prompt(1, 60), LONG)
    engine.step()
    assert 0 < a.seqs[0].num_computed_tokens < a.num_prompt_tokens
    assert engine.stats()["kv_blocks_used"] > 0
    engine.add_request("b", prompt(2, 10), LONG)
    abort_and_check(engine, a)
    assert engine.stats()["kv_blocks_used"] == 0
    assert set(drain(engine, {"a"})) == {"b"}


def test_abort_decoding_with_parallel_samples(llm):
    engine = llm.engine
    a = engine.add_request("a", prompt(1, 20), SamplingParams(
        n=3, temperature=1.0, seed=0, max_tokens=40, ignore_eos=True))
    engine.add_request("b", prompt(2, 12), LONG)
    for _ in range(6):
        engine.step()
    assert a.status is RequestStatus.RUNNING and len(a.live_seqs) == 3
    assert all(s.num_output_tokens > 1 for s in a.seqs)
    abort_and_check(engine, a)
    assert all(s.finish_reason == "abort" for s in a.seqs)
    assert set(drain(engine, {"a"})) == {"b"}


def test_abort_swapped(llm):
    engine = llm.engine
    reqs = [engine.add_request(str(i), prompt(i, 20), LONG) for i in range(3)]
    victim = None
    for _ in range(200):
        engine.step()
        engine.check_invariants()
        if engine.scheduler.swapped:
            victim = engine.scheduler.swapped[0]
            break
    assert victim is not None, "16 blocks of 8 for 3 x 60 tokens: someone is swapped out"
    assert engine.stats()["kv_cpu_blocks_used"] > 0
    assert victim.status is RequestStatus.SWAPPED
    cpu_before = engine.stats()["kv_cpu_blocks_used"]
    abort_and_check(engine, victim)
    assert engine.stats()["kv_cpu_blocks_used"] < cpu_before
    done = drain(engine, {victim.request_id})
    assert set(done) == {r.request_id for r in reqs} - {victim.request_id}
    assert all(len(o.outputs[0].token_ids) == 40 for o in done.values())
