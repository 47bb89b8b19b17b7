"""Prometheus metrics with vLLM's names under an `octavo:` prefix.

Each app gets its own CollectorRegistry, so several servers (tests) live in one process.
Two sources feed it:
- engine-wide numbers (queues, KV blocks, waste, token and prefix-cache totals) are read from
  the engine thread's latest stats() snapshot at scrape time by a custom collector, so nothing
  has to mirror the engine's counters;
- per-request latencies are histograms observed on the engine thread as outputs leave each
  step (the server's stream may skip steps when a client lags; the engine thread sees them all).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from octavo.outputs import RequestProgress

PREFIX = "octavo:"

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)

# (metric name, stats() key, help)
GAUGES = (
    ("num_requests_running", "num_requests_running", "Requests in the running batch."),
    ("num_requests_waiting", "num_requests_waiting", "Requests waiting to be scheduled."),
    ("num_requests_swapped", "num_requests_swapped", "Requests swapped out to host memory."),
    ("kv_blocks_used", "kv_blocks_used", "KV blocks held by sequences."),
    ("kv_blocks_cached_free", "kv_blocks_cached_free",
     "Free KV blocks still holding a reusable prefix."),
    ("kv_blocks_total", "kv_blocks_total", "KV blocks in the pool."),
    ("kv_blocks_saved_by_sharing", "kv_blocks_saved_by_sharing",
     "Block-table entries served by shared blocks (forks, prefix hits)."),
    ("kv_slots_live", "kv_slots_live", "KV slots holding a token."),
    ("kv_slots_internal_waste", "kv_slots_internal_waste",
     "Empty slots in the last block of sequences."),
    ("kv_slots_reserved_waste", "kv_slots_reserved_waste",
     "Slots reserved ahead for tokens not generated yet."),
    ("kv_slots_external_waste", "kv_slots_external_waste",
     "Free slots unusable because of fragmentation."),
    ("kv_slots_free", "kv_slots_free", "Free KV slots."),
    ("kv_cpu_blocks_used", "kv_cpu_blocks_used", "Host (swap) KV blocks in use."),
    ("kv_sliding_blocks_held_max", "kv_sliding_blocks_held_max",
     "Most KV blocks one sequence holds in one sliding-window layer group."),
    ("kv_slots_out_of_window", "kv_slots_out_of_window",
     "Held slots whose tokens left every sliding window (counted as internal waste)."),
    ("kv_cache_bytes_per_token", "kv_bytes_per_token",
     "Bytes one token's K and V take in every layer, in the KV cache's dtype (scales "
     "included)."),
)
COUNTERS = (
    ("prompt_tokens", "prompt_tokens_total", "Prefill tokens computed."),
    ("generation_tokens", "generation_tokens_total", "Tokens generated."),
    ("prefix_cache_queries", "prefix_cache_query_tokens", "Prompt tokens looked up in the "
     "prefix cache."),
    ("prefix_cache_hits", "prefix_cache_hit_tokens", "Prompt tokens found in the prefix cache."),
    ("num_preemptions", "num_preemptions", "Preemptions (recompute or swap)."),
    ("kv_blocks_freed_out_of_window", "kv_blocks_freed_out_of_window",
     "KV blocks handed back because they left a sliding window."),
)
# speculative decoding (only when it is on)
SPEC_COUNTERS = (
    ("spec_decode_num_drafts", "Drafts verified (one per sequence per step)."),
    ("spec_decode_num_draft_tokens", "Draft tokens verified."),
    ("spec_decode_num_accepted_tokens", "Draft tokens accepted."),
)
PER_POS = "spec_decode_num_accepted_tokens_per_pos"
RECENT = 4096  # latest latency observations kept for the dashboard
RECENT_WINDOW_S = 30.0


class EngineStatsCollector(Collector):
    """Reads the engine's stats() snapshot on each scrape."""

    def __init__(self, stats: Callable[[], dict[str, int | float | str]], model_name: str) -> None:
        self.stats = stats
        self.model_name = model_name

    def collect(self) -> Iterable[Metric]:
        s = self.stats()
        label = ["model_name"]
        for name, key, doc in GAUGES:
            g = GaugeMetricFamily(PREFIX + name, doc, labels=label)
            g.add_metric([self.model_name], float(s.get(key, 0)))
            yield g
        # vLLM's cache_config_info: the cache's settings as labels of a constant 1
        g = GaugeMetricFamily(PREFIX + "cache_config_info", "The KV cache's configuration.",
                              labels=["model_name", "cache_dtype"])
        g.add_metric([self.model_name, str(s.get("kv_cache_dtype", "auto"))], 1.0)
        yield g
        total = s.get("kv_blocks_total", 0) or 0
        g = GaugeMetricFamily(PREFIX + "kv_cache_usage_perc",
                              "Fraction of KV blocks in use (1 = full).", labels=label)
        g.add_metric([self.model_name], s.get("kv_blocks_used", 0) / total if total else 0.0)
        yield g
        for name, key, doc in COUNTERS:
            c = CounterMetricFamily(PREFIX + name, doc, labels=label)
            c.add_metric([self.model_name], float(s.get(key, 0)))
            yield c
        if "spec_decode_num_drafts" not in s:
            return
        for name, doc in SPEC_COUNTERS:
            c = CounterMetricFamily(PREFIX + name, doc, labels=label)
            c.add_metric([self.model_name], float(s[name]))
            yield c
        c = CounterMetricFamily(PREFIX + PER_POS, "Draft tokens accepted, by position.",
                                labels=["model_name", "position"])
        for key, value in s.items():
            if key.startswith(PER_POS + "_"):
                c.add_metric([self.model_name, key[len(PER_POS) + 1:]], float(value))
        yield c


class ServerMetrics:
    """The app's registry and the per-request histograms (an OutputObserver)."""

    def __init__(self, model_name: str, stats: Callable[[], dict[str, int | float | str]]) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self.registry.register(EngineStatsCollector(stats, model_name))

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(PREFIX + name, doc, ["model_name"], buckets=buckets,
                             registry=self.registry).labels(model_name)

        self.ttft = hist("time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self.itl = hist("inter_token_latency_seconds", "Time between steps' tokens.",
                        ITL_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "Arrival to finish.", REQUEST_BUCKETS)
        self.queue = hist("request_queue_time_seconds", "Arrival to first scheduled.",
                          REQUEST_BUCKETS)
        self.success = Counter(PREFIX + "request_success", "Finished requests.",
                               ["model_name", "finished_reason"], registry=self.registry)
        # the latest observations, (monotonic time, seconds), for the dashboard's gauges
        self.recent: dict[str, deque[tuple[float, float]]] = {
            "ttft": deque(maxlen=RECENT), "itl": deque(maxlen=RECENT)}

    def recent_latencies(self, window_s: float = RECENT_WINDOW_S) -> dict[str, float | None]:
        """Median and p90 of the TTFT and inter-token latencies seen in the last `window_s`
        seconds (None where none was seen)."""
        since = time.monotonic() - window_s
        out: dict[str, float | None] = {}
        for name, obs in self.recent.items():
            xs = sorted(v for t, v in list(obs) if t >= since)
            out[f"{name}_p50_s"] = xs[len(xs) // 2] if xs else None
            out[f"{name}_p90_s"] = xs[min(len(xs) - 1, int(len(xs) * 0.9))] if xs else None
            out[f"{name}_count"] = len(xs)
        return out

    def on_progress(self, out: RequestProgress, prev_token_time: float | None) -> None:
        """Engine thread: one request one step touched (prometheus-client is thread-safe)."""
        m = out.metrics
        arrival, first, last = m.get("arrival_time"), m.get("first_token_time"), m.get(
            "last_token_time")
        if prev_token_time is None:
            if first is not None and arrival is not None:
                self.ttft.observe(max(first - arrival, 0.0))
                self.recent["ttft"].append((time.monotonic(), max(first - arrival, 0.0)))
        elif last is not None and last > prev_token_time:
            self.itl.observe(last - prev_token_time)
            self.recent["itl"].append((time.monotonic(), last - prev_token_time))
        if out.finished:
            done, scheduled = m.get("finished_time"), m.get("first_scheduled_time")
            if done is not None and arrival is not None:
                self.e2e.observe(max(done - arrival, 0.0))
            if scheduled is not None and arrival is not None:
                self.queue.observe(max(scheduled - arrival, 0.0))
            self.success.labels(self.model_name, out.finish_reason or "unknown").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
