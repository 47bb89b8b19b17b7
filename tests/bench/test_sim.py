"""The model-free replay (bench/sim.py) runs the engine's own scheduler: its settings change
what the replay does, every request runs to its output length, and every KV block is back in
the pool at the end, preemptions and sliding windows included."""

from __future__ import annotations

import pytest

from octavo.bench import workloads
from octavo.bench.sim import make_scheduler, replay, simulate
from octavo.engine.scheduler import Scheduler
from octavo.paging import KVCacheManager

WL = workloads.sharegpt(24, seed=3)


def test_replay_follows_the_engine_schedulers_settings() -> None:
    """max_num_partial_prefills exists only in the engine's scheduler: at 1, a burst starts one
    prompt per step instead of all that fit at once."""
    one = make_scheduler("paged", kv_tokens=4096, block_size=16,
                         max_model_len=WL.max_model_len, max_num_partial_prefills=1)
    assert isinstance(one, Scheduler) and one.config.max_num_partial_prefills == 1
    staggered = replay(one, WL, "paged", series_points=10**6)
    burst = simulate(WL, "paged", kv_tokens=4096, series_points=10**6)
    assert staggered.running_series[:4] == [1, 2, 3, 4]
    assert burst.running_series[0] > 4
    assert staggered.completed == burst.completed == len(WL)


@pytest.mark.parametrize("kind, window", [("contiguous-max", None),
                                          ("contiguous-request", None),
                                          ("paged", None), ("paged", 256)])
def test_every_block_goes_back(kind: str, window: int | None) -> None:
    """A budget small enough that paging preempts (and recomputes) along the way."""
    sched = make_scheduler(kind, kv_tokens=2048, block_size=16, max_model_len=WL.max_model_len,
                           window=window)
    r = replay(sched, WL, kind, arrival_rate=0.5, seed=1)
    kv = sched.kv
    assert r.completed == len(WL) and not sched.has_unfinished() and not sched.seqs
    assert kv.num_free_blocks() == kv.num_blocks and kv.stats()["kv_blocks_used"] == 0
    assert r.preemptions == sched.num_preemptions
    if isinstance(kv, KVCacheManager):
        assert r.preemptions > 0
        assert window is None or r.max_seq_slots <= (window // 16 + 1) * 16
    else:
        assert r.preemptions == 0  # a reservation never runs out mid-decode


def test_a_request_the_cache_cannot_hold_is_an_error() -> None:
    wl = workloads.Workload("long", (workloads.BenchRequest(tuple(range(100)), 200),),
                            max_model_len=512)
    with pytest.raises(ValueError, match="cannot hold it even alone"):
        simulate(wl, "paged", kv_tokens=128)
    with pytest.raises(ValueError, match="cannot hold it even alone"):
        simulate(wl, "contiguous-max", kv_tokens=256)
