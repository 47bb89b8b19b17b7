"""The scheduler -> runner contract: a plan carries what the runner has not seen (a whole
sequence, once), then only new block ids and new tokens, and tells the runner what to forget.
Block hashes are computed once per block, however often a request is tried for admission."""

from __future__ import annotations

from octavo.engine.request import Request
from octavo.engine.scheduler import Scheduler
from octavo.engine_args import EngineArgs
from octavo.paging import block_hash
from octavo.paging.block_hash import BlockHasher
from octavo.paging.kv_manager import KVCacheManager
from octavo.sampling_params import SamplingParams
from octavo.step_plan import RunnerOutput, StepPlan

BS = 4


def make(num_blocks: int = 32, caching: bool = False, **kw) -> Scheduler:
    kv = KVCacheManager(num_blocks, BS, enable_prefix_caching=caching, num_cpu_blocks=num_blocks)
    return Scheduler(EngineArgs(**kw).scheduler_config(max_model_len=num_blocks * BS), kv)


_arrivals = iter(range(10**9))


def request(rid: str, prompt: list[int], n: int = 1, max_tokens: int = 8,
            caching: bool = False) -> Request:
    params = SamplingParams(n=n, temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return Request(rid, None, prompt, params, arrival_index=next(_arrivals),
                   hasher=BlockHasher(BS) if caching else None)


def run(sched: Scheduler, token: int = 7) -> tuple[StepPlan, list]:
    plan = sched.schedule()
    out = RunnerOutput(sampled_token_ids={s: [token] for c in plan.chunks
                                          for s in c.sample_seq_ids})
    updates = sched.update_from_output(plan, out)
    sched.kv.check_invariants()
    return plan, updates


def test_a_sequence_is_sent_whole_once_then_only_what_changes():
    sched = make()
    r = request("a", list(range(10, 16)))  # 6 tokens: blocks 0 (full) and 1 (2 slots)
    sched.add_request(r)
    seq = r.seqs[0]
    plan, _ = run(sched)
    assert [s.seq_id for s in plan.new_seqs] == [seq.seq_id]
    new = plan.new_seqs[0]
    assert new.token_ids == list(range(10, 16)) and new.num_prompt_tokens == 6
    assert new.block_ids == sched.kv.block_table(seq.seq_id) and len(new.block_ids) == 2
    assert [(c.seq_id, c.token_ids, c.start_pos, c.sample_seq_ids) for c in plan.chunks] == [
        (seq.seq_id, list(range(10, 16)), 0, (seq.seq_id,))]
    assert plan.block_table_updates == [] and plan.finished_seq_ids == []
    # decode into the last block's free slots: the token only, no block ids
    plan, _ = run(sched)
    assert plan.new_seqs == [] and plan.block_table_updates == []
    assert [(c.token_ids, c.start_pos) for c in plan.chunks] == [([7], 6)]
    run(sched)
    # position 8 opens block 2: only its id travels
    plan, _ = run(sched)
    assert plan.block_table_updates == [(seq.seq_id, 2, [sched.kv.block_table(seq.seq_id)[2]])]


def test_finished_and_preempted_sequences_are_forgotten_and_sent_again():
    sched = make(num_blocks=4)  # 16 slots: two requests of 4 + 8 tokens cannot both finish
    a, b = request("a", list(range(10, 14))), request("b", list(range(20, 24)))
    sched.add_request(a)
    sched.add_request(b)
    seen_forget: set[int] = set()
    resent = []
    for _ in range(100):
        if not sched.has_unfinished():
            break
        plan, _ = run(sched)
        seen_forget |= set(plan.finished_seq_ids)
        resent += [s for s in plan.new_seqs if s.seq_id in seen_forget]
    assert sched.num_preemptions > 0
    assert {a.seqs[0].seq_id, b.seqs[0].seq_id} <= seen_forget
    # the victim came back with its prompt and the tokens it had generated before
    assert resent and all(len(s.token_ids) > s.num_prompt_tokens for s in resent)
    assert sched.kv.stats()["kv_blocks_used"] == 0 and not sched.seqs


def test_fan_out_samples_every_child_from_the_parents_last_chunk():
    sched = make()
    r = request("a", list(range(10, 16)), n=3)
    sched.add_request(r)
    plan, updates = run(sched)
    parent = r.seqs[0]
    (c,) = plan.chunks
    assert len(c.sample_seq_ids) == 3 and c.sample_seq_ids[0] == parent.seq_id
    children = [s for s in plan.new_seqs if s.seq_id != parent.seq_id]
    assert [s.index for s in children] == [1, 2]
    assert all(s.block_ids == sched.kv.block_table(parent.seq_id) for s in children)
    assert all(s.token_ids == list(range(10, 16)) for s in children)
    assert [len(u.new_token_ids) for u in updates[0].seqs] == [1, 1, 1]
    # the first child to write into the shared partial block gets a copy: one table update
    # replacing entry 1 and one block copy; the last writer is alone and writes in place
    plan, _ = run(sched)
    assert len(plan.block_copies) == 2
    replaced = [(start, ids) for _, start, ids in plan.block_table_updates]
    assert replaced and all(start == 1 and len(ids) == 1 for start, ids in replaced)


def test_block_hashes_are_computed_once_per_block_across_admission_attempts(monkeypatch):
    calls = []
    real = block_hash.hash_block_tokens
    monkeypatch.setattr(block_hash, "hash_block_tokens", lambda *a: calls.append(a) or real(*a))
    sched = make(num_blocks=8, caching=True)  # 32 slots
    big = request("big", list(range(100, 124)), max_tokens=6, caching=True)  # 6 blocks
    wait = request("wait", list(range(200, 220)), max_tokens=4, caching=True)  # 5 blocks
    sched.add_request(big)
    sched.add_request(wait)
    assert len(calls) == 24 // BS + 20 // BS  # each prompt block once, at arrival
    tries = 0
    while sched.has_unfinished():
        before = len(calls)
        plan, _ = run(sched)
        tries += wait.status.value == "waiting"
        # no prompt block is hashed again; at most one block per decoding sequence fills
        assert len(calls) - before <= len(plan.chunks)
    assert tries > 1, "the second request waited and was tried for admission several times"
    outputs = (len(big.seqs[0].token_ids) // BS) + (len(wait.seqs[0].token_ids) // BS)
    assert len(calls) == outputs, "one hash per full block of each request, no more"
