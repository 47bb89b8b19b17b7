"""Routing policies: which replica gets a request.

A policy sees, for each healthy replica, its load (requests in flight through the router) and
how many leading blocks of the request's prompt the router's index says it holds, and picks one:

- `prefix` (the default; SGLang's cache-aware routing, vLLM's prefix-aware router): the replica
  with the longest match, unless its load exceeds the least loaded replica's by more than
  `balance_abs_threshold` requests AND by more than `balance_rel_threshold` times (then the
  least loaded one: a hot prefix must not pile every request onto one replica); no match
  anywhere: the least loaded.

  Replicas sharing a KV tier (`--kv-offload-dir` on one directory, or one `--kv-offload-url`)
  can load what another computed: a candidate's `tier_blocks` are the prompt's leading blocks
  past its own match that the tier holds. A tier hit is cheaper than a miss but dearer than a
  pool hit (it costs `tier_cost` of a recomputed block), so where the least loaded replica
  would load the whole of the longest match's advantage from the tier, that advantage is worth
  only `tier_cost` of itself: the longest match keeps the request while its load is within
  `balance_abs_threshold * tier_cost` requests of the least loaded's (and the relative
  threshold), and a match found only in the tier goes to the least loaded replica ("tier").
- `round_robin`: each healthy replica in turn.
- `least_loaded`: the fewest requests in flight.

Ties are broken round-robin (a cursor over the replicas' positions), so equal replicas share
the work. Pure logic: no HTTP, no clock; tests drive it directly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

POLICIES = ("prefix", "round_robin", "least_loaded")
DEFAULT_BALANCE_ABS_THRESHOLD = 16
DEFAULT_BALANCE_REL_THRESHOLD = 1.5
# what loading a block from the KV tier costs, as a share of recomputing it (a 135M-parameter
# model on a CPU: reading a block's KV takes well under a tenth of computing it; see
# BENCHMARKS.md's KV tier section)
DEFAULT_TIER_COST = 0.25


@dataclass(frozen=True, slots=True)
class Candidate:
    """A healthy replica as a policy sees it. `rid`: its position among all the replicas."""

    rid: int
    in_flight: int
    matched_blocks: int = 0
    tier_blocks: int = 0  # leading blocks past matched_blocks a shared KV tier holds


@dataclass(frozen=True, slots=True)
class Decision:
    rid: int
    matched_blocks: int
    reason: str  # "prefix" | "balance" | "tier" | "least_loaded" | "round_robin"


class RoutingPolicy:
    """Base: the round-robin cursor every policy breaks ties with."""

    name = "base"

    def __init__(self) -> None:
        self._cursor = 0

    def _next_in_turn(self, tied: Sequence[Candidate]) -> Candidate:
        """The first of `tied` at or after the cursor (wrapping); the cursor moves past it."""
        ordered = sorted(tied, key=lambda c: c.rid)
        pick = next((c for c in ordered if c.rid >= self._cursor), ordered[0])
        self._cursor = pick.rid + 1
        return pick

    def choose(self, candidates: Sequence[Candidate]) -> Decision:
        if not candidates:
            raise ValueError("no healthy replica to route to")
        return self._choose(candidates)

    def _choose(self, candidates: Sequence[Candidate]) -> Decision:
        raise NotImplementedError

    def _least_loaded(self, candidates: Sequence[Candidate], reason: str) -> Decision:
        low = min(c.in_flight for c in candidates)
        idle = [c for c in candidates if c.in_flight == low]
        best = max(c.matched_blocks for c in idle)  # among the least loaded, the best match
        pick = self._next_in_turn([c for c in idle if c.matched_blocks == best])
        return Decision(pick.rid, pick.matched_blocks, reason)


class RoundRobinPolicy(RoutingPolicy):
    name = "round_robin"

    def _choose(self, candidates: Sequence[Candidate]) -> Decision:
        pick = self._next_in_turn(candidates)
        return Decision(pick.rid, pick.matched_blocks, "round_robin")


class LeastLoadedPolicy(RoutingPolicy):
    name = "least_loaded"

    def _choose(self, candidates: Sequence[Candidate]) -> Decision:
        low = min(c.in_flight for c in candidates)
        pick = self._next_in_turn([c for c in candidates if c.in_flight == low])
        return Decision(pick.rid, pick.matched_blocks, "least_loaded")


class PrefixPolicy(RoutingPolicy):
    name = "prefix"

    def __init__(self, balance_abs_threshold: int = DEFAULT_BALANCE_ABS_THRESHOLD,
                 balance_rel_threshold: float = DEFAULT_BALANCE_REL_THRESHOLD,
                 tier_cost: float = DEFAULT_TIER_COST) -> None:
        super().__init__()
        if balance_abs_threshold < 0:
            raise ValueError(f"balance_abs_threshold must be >= 0, got {balance_abs_threshold}")
        if not balance_rel_threshold >= 1.0:
            raise ValueError(f"balance_rel_threshold must be >= 1, got {balance_rel_threshold}")
        if not 0.0 <= tier_cost <= 1.0:
            raise ValueError(f"tier_cost must be in [0, 1], got {tier_cost}")
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.tier_cost = tier_cost

    def overloaded(self, load: int, least: int, abs_threshold: float | None = None) -> bool:
        limit = self.balance_abs_threshold if abs_threshold is None else abs_threshold
        return load - least > limit and load > self.balance_rel_threshold * least

    def _choose(self, candidates: Sequence[Candidate]) -> Decision:
        longest = max(c.matched_blocks for c in candidates)
        if longest == 0:
            tier = any(c.tier_blocks for c in candidates)
            return self._least_loaded(candidates, "tier" if tier else "least_loaded")
        holders = [c for c in candidates if c.matched_blocks == longest]
        low = min(c.in_flight for c in holders)
        least = min(c.in_flight for c in candidates)
        if self.overloaded(low, least):
            return self._least_loaded(candidates, "balance")
        idle = [c for c in candidates if c.in_flight == least]
        if all(c.matched_blocks + c.tier_blocks >= longest for c in idle) and self.overloaded(
                low, least, self.balance_abs_threshold * self.tier_cost):
            # the least loaded replicas can load the holders' whole advantage from the tier
            return self._least_loaded(candidates, "tier")
        pick = self._next_in_turn([c for c in holders if c.in_flight == low])
        return Decision(pick.rid, pick.matched_blocks, "prefix")


def make_policy(name: str, *, balance_abs_threshold: int = DEFAULT_BALANCE_ABS_THRESHOLD,
                balance_rel_threshold: float = DEFAULT_BALANCE_REL_THRESHOLD,
                tier_cost: float = DEFAULT_TIER_COST) -> RoutingPolicy:
    if name == "prefix":
        return PrefixPolicy(balance_abs_threshold, balance_rel_threshold, tier_cost)
    if name == "round_robin":
        return RoundRobinPolicy()
    if name == "least_loaded":
        return LeastLoadedPolicy()
    raise ValueError(f"unknown routing policy {name!r}: one of {', '.join(POLICIES)}")
