"""The prefix policy with a KV tier the replicas share: a tier hit is cheaper than a miss, so
a request whose prefix the least loaded replica can load from the tier leaves the busy
replica that holds it sooner; a match only the tier has goes to the least loaded replica."""

from __future__ import annotations

from octavo.router.dispatch import Dispatcher
from octavo.router.metrics import RouterMetrics
from octavo.router.policy import Candidate, PrefixPolicy
from octavo.router.prompts import PromptKeys
from octavo.router.replicas import ReplicaSet
from tests.router.test_policy import PREFIX_A, hashes


def test_a_prefix_the_idle_replica_can_load_from_the_tier_leaves_the_busy_holder():
    policy = PrefixPolicy(balance_abs_threshold=16, balance_rel_threshold=1.5, tier_cost=0.25)
    busy_holder = Candidate(0, in_flight=9, matched_blocks=8)
    # without a tier the idle replica would recompute 8 blocks: the holder keeps the request
    assert policy.choose([busy_holder, Candidate(1, 2)]).rid == 0
    # with the 8 blocks in the tier it loads them: 7 more requests in flight outweigh that
    decision = policy.choose([busy_holder, Candidate(1, 2, tier_blocks=8)])
    assert (decision.rid, decision.reason) == (1, "tier")
    # a holder only slightly busier keeps it: a pool hit is still cheaper than a tier hit
    assert policy.choose([Candidate(0, 4, 8), Candidate(1, 2, tier_blocks=8)]).rid == 0
    # the tier covering only part of the advantage: no change
    assert policy.choose([busy_holder, Candidate(1, 2, tier_blocks=5)]).rid == 0


def test_a_match_only_the_tier_holds_goes_to_the_least_loaded():
    policy = PrefixPolicy()
    decision = policy.choose([Candidate(0, 3, tier_blocks=4), Candidate(1, 1, tier_blocks=4)])
    assert (decision.rid, decision.reason) == (1, "tier")


def test_the_dispatcher_counts_what_any_replica_was_sent_as_in_the_shared_tier():
    replicas = ReplicaSet(["http://a:1", "http://b:2"], index_blocks=64)
    for r in replicas:
        r.healthy = True
    keys = PromptKeys(hashes(PREFIX_A), len(PREFIX_A), True)
    for shared, reason in ((True, "tier"), (False, "least_loaded")):
        dispatcher = Dispatcher(replicas, PrefixPolicy(), RouterMetrics(replicas), 4,
                                shared_tier=shared)
        dispatcher.begin(replicas.replicas[0], keys, "prefix", 0)
        pick = dispatcher.pick(keys, exclude={0})  # replica 1 was never sent the prompt
        assert pick is not None and (pick.rid, pick.reason) == (1, reason)
        dispatcher.end(replicas.replicas[0])
