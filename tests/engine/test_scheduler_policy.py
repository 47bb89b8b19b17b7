"""Scheduler policy at unit level (no model): the scheduler runs over a real KV manager, and a
fake runner samples token 7 for every sequence that asks; the scheduler's own
update_from_output moves the sequences on (forks, finishes, frees)."""

from __future__ import annotations

import pytest

from octavo.engine.request import Request, RequestStatus
from octavo.engine.scheduler import Scheduler
from octavo.engine_args import EngineArgs
from octavo.paging.kv_manager import KVCacheManager
from octavo.sampling_params import SamplingParams
from octavo.step_plan import RunnerOutput, StepPlan


def make_scheduler(policy: str, num_blocks: int, block_size: int = 4, **kw) -> Scheduler:
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=False,
                        num_cpu_blocks=num_blocks)
    config = EngineArgs(scheduling_policy=policy, **kw).scheduler_config(
        max_model_len=num_blocks * block_size)
    return Scheduler(config, kv)


_arrivals = iter(range(10**9))


def make_request(rid: str, prompt_len: int, priority: int = 0, max_tokens: int = 64,
                 n: int = 1) -> Request:
    params = SamplingParams(n=n, temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return Request(rid, None, list(range(10, 10 + prompt_len)), params,
                   arrival_index=next(_arrivals), priority=priority)


def fake_runner(plan: StepPlan) -> RunnerOutput:
    return RunnerOutput(sampled_token_ids={
        seq_id: [7] for c in plan.chunks for seq_id in c.sample_seq_ids})


def step(scheduler: Scheduler) -> StepPlan:
    """One engine step without a model."""
    plan = scheduler.schedule()
    scheduler.update_from_output(plan, fake_runner(plan))
    scheduler.kv.check_invariants()
    return plan


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_waiting_order(policy):
    """With room for one request at a time, the priority policy admits the lowest priority
    number first whatever the arrival order; fcfs admits by arrival."""
    sched = make_scheduler(policy, num_blocks=64, max_num_seqs=1)
    reqs = [make_request("a", 5, priority=5, max_tokens=2),
            make_request("b", 5, priority=0, max_tokens=2),
            make_request("c", 5, priority=1, max_tokens=2)]
    for r in reqs:
        sched.add_request(r)
    order: list[str] = []
    for _ in range(50):
        if not sched.has_unfinished():
            break
        plan = sched.schedule()
        ids = {sched.seqs[c.seq_id].request.request_id for c in plan.chunks}
        sched.update_from_output(plan, fake_runner(plan))
        sched.kv.check_invariants()
        order += sorted(ids - set(order))
        assert len(ids) <= 1
    assert not sched.has_unfinished()
    assert order == (["b", "c", "a"] if policy == "priority" else ["a", "b", "c"])
    assert sched.kv.stats()["kv_blocks_used"] == 0


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_preemption_victim(policy, mode):
    """When decode growth runs out of blocks, the lowest-ranked running request is preempted:
    the later arrival under fcfs, the higher priority number under priority, even when that
    request arrived first."""
    sched = make_scheduler(policy, num_blocks=4, block_size=4, preemption_mode=mode)
    low = make_request("low", 4, priority=10, max_tokens=12)  # arrives first
    high = make_request("high", 4, priority=0, max_tokens=12)
    sched.add_request(low)
    sched.add_request(high)
    swapped_seen = False
    for _ in range(200):
        if not sched.has_unfinished():
            break
        before = sched.num_preemptions
        plan = step(sched)
        if mode == "swap" and sched.num_preemptions > before:
            assert plan.swap_out and sched.swapped and sched.swapped[0].status is (
                RequestStatus.SWAPPED)
            swapped_seen = True
    assert not sched.has_unfinished()
    preempted = {r.request_id for r in (low, high) if r.num_preemptions}
    assert preempted, "memory for 2 x 16 tokens in 16 slots: someone must be preempted"
    assert swapped_seen == (mode == "swap")
    victim = "low" if policy == "priority" else "high"
    assert preempted == {victim}
    stats = sched.kv.stats()
    assert stats["kv_blocks_used"] == 0 and stats["kv_cpu_blocks_used"] == 0


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_late_high_priority_request_finishes_first(policy):
    """A high-priority request arriving while a low-priority one runs takes the memory both
    cannot have at once, and finishes first; under fcfs the earlier arrival finishes first."""
    sched = make_scheduler(policy, num_blocks=5, block_size=4)
    low = make_request("low", 8, priority=3, max_tokens=8)
    sched.add_request(low)
    step(sched)  # low prefills alone
    high = make_request("high", 8, priority=0, max_tokens=8)
    sched.add_request(high)
    finished: list[str] = []
    for _ in range(100):
        if not sched.has_unfinished():
            break
        step(sched)
        finished += [r.request_id for r in (low, high)
                     if r.is_finished and r.request_id not in finished]
    assert sched.num_preemptions > 0
    assert finished == (["high", "low"] if policy == "priority" else ["low", "high"])
    assert sched.kv.stats()["kv_blocks_used"] == 0


def test_max_num_seqs_counts_samples_not_forked_yet():
    """A request with n samples takes n of max_num_seqs from its admission, although it runs
    one sequence until its prompt is computed (then it forks)."""
    sched = make_scheduler("fcfs", num_blocks=64, max_num_seqs=4)
    a = make_request("a", 6, n=3, max_tokens=4)
    b = make_request("b", 6, n=2, max_tokens=4)
    sched.add_request(a)
    sched.add_request(b)
    both_running = False
    for _ in range(50):
        if not sched.has_unfinished():
            break
        step(sched)
        assert sched.num_running_seqs <= 4
        both_running |= a.status is b.status is RequestStatus.RUNNING
    assert a.is_finished and b.is_finished and not both_running
    assert sched.kv.stats()["kv_blocks_used"] == 0


def test_waiting_high_priority_preempts_running_low_priority():
    sched = make_scheduler("priority", num_blocks=4, block_size=4)
    low = make_request("low", 12, priority=5, max_tokens=20)
    sched.add_request(low)
    step(sched)  # low holds 3 of the 4 blocks and keeps growing
    high = make_request("high", 8, priority=0, max_tokens=2)
    sched.add_request(high)
    plan = sched.schedule()
    assert (low.num_preemptions, high.num_preemptions) == (1, 0)
    assert high.seqs[0].seq_id in [c.seq_id for c in plan.chunks]
    assert low.seqs[0].seq_id in plan.finished_seq_ids, "the runner forgets the victim"


def test_a_preempted_decode_leaves_the_plan_it_was_scheduled_in():
    """Decodes are scheduled before prompts: when a higher-ranked request still in its prompt
    runs out of blocks after a lower-ranked decode was scheduled, the decode is preempted and
    taken out of this step's plan again (recomputed later), never both run and preempted."""
    sched = make_scheduler("fcfs", num_blocks=9, block_size=4, max_num_batched_tokens=8,
                           long_prefill_token_threshold=4)
    a, b = make_request("a", 30, max_tokens=4), make_request("b", 3, max_tokens=40)
    sched.add_request(a)
    sched.add_request(b)
    taken_back = 0
    while sched.has_unfinished():
        plan = sched.schedule()
        scheduled = {c.seq_id for c in plan.chunks}
        assert not scheduled & set(plan.finished_seq_ids), "a chunk of a preempted sequence"
        taken_back += b.seqs[0].seq_id in plan.finished_seq_ids
        sched.update_from_output(plan, fake_runner(plan))
        sched.kv.check_invariants()
    assert taken_back and b.num_preemptions
    assert len(a.seqs[0].output_token_ids) == 4
    assert sched.kv.stats()["kv_blocks_used"] == 0
