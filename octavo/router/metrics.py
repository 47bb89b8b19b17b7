"""The router's Prometheus metrics, one series per replica (label `replica`: its URL).

Counters are counted as requests go; the gauges (requests in flight, health, index size) are
read from the replicas' state at scrape time. The replicas' own prefix-cache counters
(`vllm:prefix_cache_hits_total`, `vllm:prefix_cache_queries_total`) are on each replica's
own /metrics; `octavo:router_prefix_match_tokens_total` is the router's estimate of them.
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from octavo.router.replicas import Replica, ReplicaSet

PREFIX = "octavo:router_"


class ReplicaStateCollector(Collector):
    def __init__(self, replicas: ReplicaSet) -> None:
        self.replicas = replicas

    def collect(self) -> Iterable[Metric]:
        gauges = (
            ("requests_in_flight", "Requests forwarded to the replica and not finished.",
             lambda r: r.in_flight),
            ("replica_healthy", "1 while the replica's /health answers 200.",
             lambda r: int(r.healthy)),
            ("index_blocks", "Block hashes the router remembers sending to the replica.",
             lambda r: len(r.index)),
        )
        for name, doc, value in gauges:
            g = GaugeMetricFamily(PREFIX + name, doc, labels=["replica"])
            for r in self.replicas:
                g.add_metric([r.url], float(value(r)))
            yield g


class RouterMetrics:
    def __init__(self, replicas: ReplicaSet) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(ReplicaStateCollector(replicas))
        self.routed = Counter(PREFIX + "requests", "Requests routed, by the policy's reason "
                              "(prefix, balance, least_loaded, round_robin, pinned).",
                              ["replica", "reason"], registry=self.registry)
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens routed (text "
                                     "bytes / 4 where the prompt was hashed as text).",
                                     ["replica"], registry=self.registry)
        self.match_tokens = Counter(PREFIX + "prefix_match_tokens", "Prompt tokens the router "
                                    "expected the replica to find in its prefix cache.",
                                    ["replica"], registry=self.registry)
        self.errors = Counter(PREFIX + "upstream_errors", "Requests the replica failed to "
                              "answer (refused connections, broken streams).", ["replica"],
                              registry=self.registry)
        for r in replicas:  # every series exists from the start, at 0
            self.prompt_tokens.labels(r.url)
            self.match_tokens.labels(r.url)
            self.errors.labels(r.url)

    def routed_to(self, replica: Replica, reason: str, prompt_tokens: int,
                  match_tokens: int) -> None:
        self.routed.labels(replica.url, reason).inc()
        self.prompt_tokens.labels(replica.url).inc(prompt_tokens)
        self.match_tokens.labels(replica.url).inc(match_tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)
