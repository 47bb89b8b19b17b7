"""Randomized engine runs on the tiny random-weight model: random arrivals, aborts, n, prompt
sharing, in tiny memory, with both preemption modes and prefix caching on, with and without
speculative decoding (n-gram drafts accepted and rejected). The KV manager's
invariants hold after every step, every block returns to the pool, and the greedy and seeded
outputs of the requests that finished equal those of a roomy engine that never preempts."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from octavo import LLM, SamplingParams
from tests.engine.conftest import tokens_prompt

MAX_MODEL_LEN = 64
CAPACITY = 96  # KV slots: every request fits alone, a few at once do not
BUDGET = 16  # max_num_batched_tokens: long prompts are chunked
MAX_SEQS = 6


@dataclass
class Submitted:
    prompt: list[int]
    params: SamplingParams
    kind: str  # "greedy", "seeded", "random"


def random_request(rng: random.Random, prefixes: list[list[int]]) -> Submitted:
    n = rng.choice([1, 1, 2, 3])
    if n == 1:  # may run into max_model_len
        plen, max_tokens = rng.randint(1, 55), rng.randint(1, 24)
    else:  # n samples must fit in memory together
        plen, max_tokens = rng.randint(1, 30), rng.randint(1, 16)
    if rng.random() < 0.5:  # shares a prefix with other requests (prefix-cache hits)
        base = rng.choice(prefixes)
        cut = max(0, min(plen, len(base)) - rng.randint(0, 3))
        prompt = base[:cut] + [rng.randrange(3, 256) for _ in range(plen - cut)]
    else:
        prompt = [rng.randrange(3, 256) for _ in range(plen)]
    kind = rng.choice(["greedy", "greedy", "seeded", "random"])
    params = SamplingParams(
        n=n,
        temperature=0.0 if kind == "greedy" else 1.0,
        seed=rng.randrange(1000) if kind == "seeded" else None,
        max_tokens=max_tokens,
        ignore_eos=rng.random() < 0.5,
    )
    return Submitted(prompt, params, kind)


@pytest.fixture(scope="module")
def reference_llm(tiny_llama_dir) -> LLM:
    # the same max_model_len (it caps outputs), memory for everything, no cache, no chunking
    return LLM(str(tiny_llama_dir), block_size=16, num_kv_blocks=256,
               max_model_len=MAX_MODEL_LEN, enable_prefix_caching=False)


# speculative decoding: n-gram drafts on every decode that finds one (no cost model), so
# accepted and rejected drafts mix with aborts, preemption and chunked prefill; and a draft
# model (the tiny model itself: its own paged KV cache with the target's block tables)
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
        "prompt_lookup_max": 2, "cost_model": False}
CASES = [(mode, bs, seed, spec) for spec in ("", "ngram") for seed in range(6)
         for mode in ("recompute", "swap") for bs in (1, 8)]
CASES += [("recompute", 8, 0, "draft"), ("swap", 1, 1, "draft"), ("swap", 8, 2, "draft")]


def spec_config(spec: str, model_dir) -> dict | None:
    if spec == "draft":
        return {"method": "draft_model", "model": str(model_dir), "num_speculative_tokens": 3,
                "cost_model": False}
    return SPEC if spec == "ngram" else None


@pytest.mark.parametrize("mode,block_size,seed,spec", CASES,
                         ids=[f"{m}-bs{b}-seed{s}{'-' + sp if sp else ''}"
                              for m, b, s, sp in CASES])
def test_random_engine_run(tiny_llama_dir, reference_llm, mode, block_size, seed, spec):
    rng = random.Random(seed)
    llm = LLM(str(tiny_llama_dir), block_size=block_size,
              num_kv_blocks=CAPACITY // block_size, max_model_len=MAX_MODEL_LEN,
              max_num_batched_tokens=BUDGET, max_num_seqs=MAX_SEQS,
              enable_prefix_caching=True, preemption_mode=mode,
              speculative_config=spec_config(spec, tiny_llama_dir))
    engine, kv = llm.engine, llm.engine.kv
    prefixes = [[rng.randrange(3, 256) for _ in range(40)] for _ in range(3)]
    submitted: dict[str, Submitted] = {}
    finished: dict[str, object] = {}
    aborted: set[str] = set()
    num_requests, next_id, steps = 60, 0, 0
    while next_id < num_requests or engine.has_unfinished_requests():
        steps += 1
        assert steps < 3000, "the engine stopped making progress"
        for _ in range(rng.choice([0, 0, 0, 1, 1, 2, 3])):  # random arrivals
            if next_id < num_requests:
                sub = random_request(rng, prefixes)
                rid = f"r{next_id}"
                next_id += 1
                submitted[rid] = sub
                engine.add_request(rid, tokens_prompt(sub.prompt), sub.params)
        live = [r for r in engine.requests.values() if not r.is_finished]
        if live and rng.random() < 0.08:  # random abort, in whatever state it is
            victim = rng.choice(live)
            assert engine.abort_request(victim.request_id)
            aborted.add(victim.request_id)
            kv.check_invariants()
        if not engine.has_unfinished_requests():
            continue
        for out in engine.step():
            assert out.request_id not in aborted
            if out.finished:
                assert out.request_id not in finished
                finished[out.request_id] = out
        kv.check_invariants()
        sched = engine.scheduler
        assert sched.num_running_seqs <= MAX_SEQS
        assert kv.stats()["kv_blocks_used"] <= kv.num_blocks

    stats = llm.stats()
    assert stats["kv_blocks_used"] == 0 and stats["kv_cpu_blocks_used"] == 0
    assert kv.num_free_blocks() == kv.num_blocks
    assert not engine.requests
    assert set(finished) | aborted == set(submitted) and not set(finished) & aborted
    assert stats["num_preemptions"] > 0, "tiny memory: the run should preempt"
    assert stats["prefix_cache_hit_tokens"] > 0
    assert len(aborted) >= 2
    if spec:
        assert 0 < stats["spec_decode_num_accepted_tokens"] <= stats[
            "spec_decode_num_draft_tokens"]

    # outputs of finished greedy / seeded requests equal a roomy engine's
    ids = [rid for rid in finished if submitted[rid].kind != "random"]
    refs = reference_llm.generate(
        [tokens_prompt(submitted[rid].prompt) for rid in ids],
        [submitted[rid].params for rid in ids], use_tqdm=False,
    )
    for rid, ref in zip(ids, refs, strict=True):
        got = finished[rid]
        assert len(got.outputs) == submitted[rid].params.n
        for a, b in zip(got.outputs, ref.outputs, strict=True):
            assert a.token_ids == b.token_ids, f"{rid} ({submitted[rid].kind}) differs"
            assert a.finish_reason == b.finish_reason
    for rid, out in finished.items():
        p = submitted[rid].params
        for o in out.outputs:
            assert 1 <= len(o.token_ids) <= p.max_tokens
            assert len(submitted[rid].prompt) + len(o.token_ids) <= MAX_MODEL_LEN
            assert o.finish_reason in ("stop", "length")
    assert reference_llm.stats()["kv_blocks_used"] == 0
