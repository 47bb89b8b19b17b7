"""Where a request goes and what the router remembers of it: the policy's choice among the
healthy replicas, the request's blocks recorded in that replica's index (and, where the
replicas share a KV tier, in the tier's index: any of them can load those blocks), its load
counted."""

from __future__ import annotations

from collections.abc import Collection

from octavo.router.metrics import RouterMetrics
from octavo.router.policy import Candidate, Decision, RoutingPolicy
from octavo.router.prefix_index import PrefixIndex
from octavo.router.prompts import PromptKeys
from octavo.router.replicas import Replica, ReplicaSet

TIER_INDEX_FACTOR = 16


class Dispatcher:
    def __init__(self, replicas: ReplicaSet, policy: RoutingPolicy, metrics: RouterMetrics,
                 block_size: int, *, shared_tier: bool = False) -> None:
        self.replicas = replicas
        self.policy = policy
        self.metrics = metrics
        self.block_size = block_size
        # what the replicas' shared KV tier holds, as far as the router sent it there (a tier
        # is many pools' worth)
        self.tier_index = (PrefixIndex(TIER_INDEX_FACTOR * max(
            (r.index.capacity for r in replicas), default=1)) if shared_tier else None)

    def pick(self, keys: PromptKeys, exclude: Collection[int] = ()) -> Decision | None:
        """The policy's choice among the healthy replicas not in `exclude` (None: there is
        none)."""
        healthy = [r for r in self.replicas.healthy() if r.rid not in exclude]
        if not healthy:
            return None
        in_tier = 0 if self.tier_index is None else self.tier_index.match(keys.block_hashes)
        candidates = []
        for r in healthy:
            matched = r.index.match(keys.block_hashes)
            candidates.append(Candidate(r.rid, r.in_flight, matched, max(0, in_tier - matched)))
        return self.policy.choose(candidates)

    def replica(self, decision: Decision) -> Replica:
        return self.replicas.replicas[decision.rid]

    def begin(self, replica: Replica, keys: PromptKeys, reason: str,
              matched_blocks: int) -> None:
        """The request is on its way to `replica`: count it, record its blocks there."""
        replica.in_flight += 1
        for hashes in keys.all_block_hashes:
            if hashes:
                replica.index.insert(hashes)
                if self.tier_index is not None:
                    self.tier_index.insert(hashes)
        self.metrics.routed_to(replica, reason, keys.num_tokens,
                               matched_blocks * self.block_size)

    def end(self, replica: Replica) -> None:
        replica.in_flight -= 1

    def failed(self, replica: Replica, reason: str, *, down: bool) -> None:
        """The replica failed a request; `down`: it refused the connection (no traffic until a
        health check finds it up)."""
        self.metrics.errors.labels(replica.url).inc()
        if down:
            self.replicas.mark_down(replica, reason)
