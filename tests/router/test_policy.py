"""The routing policies and the router's per-replica index, driven directly (no HTTP)."""

from __future__ import annotations

import pytest

from octavo.paging.block_hash import BlockHasher
from octavo.router.policy import Candidate, make_policy
from octavo.router.prefix_index import PrefixIndex


def hashes(tokens: list[int], block_size: int = 4) -> list[bytes]:
    out: list[bytes] = []
    BlockHasher(block_size).extend(out, tokens, None)
    return out


PREFIX_A = list(range(100, 116))  # 4 blocks of 4
PREFIX_B = list(range(200, 216))


def test_index_matches_the_leading_run_of_blocks_only():
    index = PrefixIndex(capacity=100)
    index.insert(hashes(PREFIX_A + [1, 2, 3, 4]))
    assert index.match(hashes(PREFIX_A + [9, 9, 9, 9])) == 4  # the shared prefix, not the tail
    assert index.match(hashes(PREFIX_A[:8])) == 2
    assert index.match(hashes(PREFIX_B)) == 0
    # chained hashes: the same tokens after a different first block are different blocks
    assert index.match(hashes([0, 0, 0, 0] + PREFIX_A)) == 0
    assert index.match([]) == 0


def test_index_is_bounded_and_forgets_the_least_recent_prompt_tail_first():
    index = PrefixIndex(capacity=6)
    a, b = hashes(PREFIX_A), hashes(PREFIX_B)
    index.insert(a)
    index.insert(b)
    assert len(index) == 6  # never more than the capacity
    # a was sent first: its last two blocks went, its first two still match
    assert index.match(a) == 2 and index.match(b) == 4
    index.insert(a)  # a is the most recent now: b loses its tail
    assert index.match(a) == 4 and index.match(b) == 2 and len(index) == 6
    for i in range(20):
        index.insert(hashes([i] * 8))
    assert len(index) == 6 and index.match(a) == 0 and index.match(b) == 0
    index.resize(2)
    assert len(index) == 2
    with pytest.raises(ValueError, match="at least 1 block"):
        PrefixIndex(0)


def test_prefix_policy_picks_the_longest_match():
    policy = make_policy("prefix")
    d = policy.choose([Candidate(0, in_flight=0, matched_blocks=2),
                       Candidate(1, in_flight=3, matched_blocks=5),
                       Candidate(2, in_flight=1, matched_blocks=0)])
    assert (d.rid, d.matched_blocks, d.reason) == (1, 5, "prefix")


def test_prefix_policy_balances_a_replica_loaded_past_both_thresholds():
    policy = make_policy("prefix", balance_abs_threshold=4, balance_rel_threshold=2.0)
    # 6 more in flight (> 4) and 7x the least loaded (> 2x): the least loaded wins
    d = policy.choose([Candidate(0, in_flight=7, matched_blocks=8),
                       Candidate(1, in_flight=1, matched_blocks=1),
                       Candidate(2, in_flight=1, matched_blocks=0)])
    assert (d.rid, d.reason) == (1, "balance")  # among the least loaded, the better match
    # within the absolute threshold: affinity wins
    assert policy.choose([Candidate(0, 5, 8), Candidate(1, 1, 0)]).rid == 0
    # past the absolute threshold but not the relative one: affinity wins
    assert policy.choose([Candidate(0, 30, 8), Candidate(1, 20, 0)]).rid == 0


def test_prefix_policy_without_a_match_goes_to_the_least_loaded_in_turn():
    policy = make_policy("prefix")
    d = policy.choose([Candidate(0, 3), Candidate(1, 1), Candidate(2, 2)])
    assert (d.rid, d.reason) == (1, "least_loaded")
    tied = [Candidate(0, 0), Candidate(1, 0), Candidate(2, 0)]
    assert [policy.choose(tied).rid for _ in range(4)] == [2, 0, 1, 2]  # on from replica 1


def test_round_robin_takes_each_healthy_replica_in_turn():
    policy = make_policy("round_robin")
    all3 = [Candidate(0, 9, 5), Candidate(1, 0), Candidate(2, 0)]
    assert [policy.choose(all3).rid for _ in range(4)] == [0, 1, 2, 0]
    # replica 2 is down: it is skipped, the turn goes on
    assert [policy.choose(all3[:2]).rid for _ in range(3)] == [1, 0, 1]
    assert policy.choose(all3).reason == "round_robin"


def test_least_loaded_ignores_prefixes():
    policy = make_policy("least_loaded")
    d = policy.choose([Candidate(0, 2, 10), Candidate(1, 1, 0)])
    assert (d.rid, d.reason) == (1, "least_loaded")
    tied = [Candidate(0, 1), Candidate(1, 1)]
    assert [policy.choose(tied).rid for _ in range(3)] == [0, 1, 0]


def test_bad_policies_are_refused():
    with pytest.raises(ValueError, match="unknown routing policy 'random'"):
        make_policy("random")
    with pytest.raises(ValueError, match="balance_rel_threshold must be >= 1"):
        make_policy("prefix", balance_rel_threshold=0.5)
    with pytest.raises(ValueError, match="no healthy replica"):
        make_policy("round_robin").choose([])
