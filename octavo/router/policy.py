"""Routing policies: which replica gets a request.

A policy sees, for each healthy replica, its load (requests in flight through the router) and
how many leading blocks of the request's prompt the router's index says it holds, and picks one:

- `prefix` (the default; SGLang's cache-aware routing, vLLM's prefix-aware router): the replica
  with the longest match, unless its load exceeds the least loaded replica's by more than
  `balance_abs_threshold` requests AND by more than `balance_rel_threshold` times (then the
  least loaded one: a hot prefix must not pile every request onto one replica); no match
  anywhere: the least loaded.
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


@dataclass(frozen=True, slots=True)
class Candidate:
    """A healthy replica as a policy sees it. `rid`: its position among all the replicas."""

    rid: int
    in_flight: int
    matched_blocks: int = 0


@dataclass(frozen=True, slots=True)
class Decision:
    rid: int
    matched_blocks: int
    reason: str  # "prefix" | "balance" | "least_loaded" | "round_robin"


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
                 balance_rel_threshold: float = DEFAULT_BALANCE_REL_THRESHOLD) -> None:
        super().__init__()
        if balance_abs_threshold < 0:
            raise ValueError(f"balance_abs_threshold must be >= 0, got {balance_abs_threshold}")
        if not balance_rel_threshold >= 1.0:
            raise ValueError(f"balance_rel_threshold must be >= 1, got {balance_rel_threshold}")
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold

    def overloaded(self, load: int, least: int) -> bool:
        return (load - least > self.balance_abs_threshold
                and load > self.balance_rel_threshold * least)

    def _choose(self, candidates: Sequence[Candidate]) -> Decision:
        longest = max(c.matched_blocks for c in candidates)
        if longest == 0:
            return self._least_loaded(candidates, "least_loaded")
        holders = [c for c in candidates if c.matched_blocks == longest]
        low = min(c.in_flight for c in holders)
        if self.overloaded(low, min(c.in_flight for c in candidates)):
            return self._least_loaded(candidates, "balance")
        pick = self._next_in_turn([c for c in holders if c.in_flight == low])
        return Decision(pick.rid, pick.matched_blocks, "prefix")


def make_policy(name: str, *, balance_abs_threshold: int = DEFAULT_BALANCE_ABS_THRESHOLD,
                balance_rel_threshold: float = DEFAULT_BALANCE_REL_THRESHOLD) -> RoutingPolicy:
    if name == "prefix":
        return PrefixPolicy(balance_abs_threshold, balance_rel_threshold)
    if name == "round_robin":
        return RoundRobinPolicy()
    if name == "least_loaded":
        return LeastLoadedPolicy()
    raise ValueError(f"unknown routing policy {name!r}: one of {', '.join(POLICIES)}")
