"""Prometheus metrics: vLLM's names, label sets and buckets, plus octavo's own paging gauges.

Dashboards, autoscalers and routers built for vLLM read `vllm:num_requests_waiting`,
`vllm:kv_cache_usage_perc`, the token counters and the per-request histograms, labelled
`model_name` and `engine` (always "0": one engine per server), so every metric vLLM has is
served under vLLM's name (vllm/v1/metrics/loggers.py). What only octavo measures (KV blocks and
slots, the waste split, swapped requests, sliding windows) keeps the `octavo:` prefix; the
router reads `octavo:kv_blocks_total` from each replica.

Each app gets its own CollectorRegistry, so several servers (tests) live in one process.
Two sources feed it:
- engine-wide numbers (queues, KV blocks, waste, token and prefix-cache totals, the KV tier's
  traffic and occupancy) are read from the engine thread's latest stats() snapshot at scrape
  time by a custom collector, so nothing has to mirror the engine's counters;
- per-request numbers are histograms observed on the engine thread as requests leave each
  step (the server's stream may skip steps when a client lags; the engine thread sees them all).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    Metric,
    SummaryMetricFamily,
)
from prometheus_client.registry import Collector

from octavo.outputs import RequestProgress

VLLM = "vllm:"
OCTAVO = "octavo:"
LABELS = ("model_name", "engine")
ENGINE_INDEX = "0"

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
ITERATION_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)

# (metric name, stats() key, help); vLLM's gauges, then octavo's
VLLM_GAUGES = (
    ("num_requests_running", "num_requests_running",
     "Number of requests in model execution batches."),
    ("num_requests_waiting", "num_requests_waiting", "Number of requests waiting to be processed."),
)
OCTAVO_GAUGES = (
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
# counters: (name without _total, stats() key, help)
VLLM_COUNTERS = (
    ("prompt_tokens", "prompt_tokens_total", "Number of prefill tokens processed."),
    ("generation_tokens", "generation_tokens_total", "Number of generation tokens processed."),
    ("prefix_cache_queries", "prefix_cache_query_tokens",
     "Prefix cache queries, in terms of number of queried tokens."),
    ("prefix_cache_hits", "prefix_cache_hit_tokens",
     "Prefix cache hits, in terms of number of cached tokens."),
    ("num_preemptions", "num_preemptions", "Cumulative number of preemption from the engine."),
)
OCTAVO_COUNTERS = (
    ("kv_blocks_freed_out_of_window", "kv_blocks_freed_out_of_window",
     "KV blocks handed back because they left a sliding window."),
)
# speculative decoding (only when it is on)
SPEC_COUNTERS = (
    ("spec_decode_num_drafts", "Number of spec decoding drafts."),
    ("spec_decode_num_draft_tokens", "Number of draft tokens."),
    ("spec_decode_num_accepted_tokens", "Number of accepted tokens."),
)
# the KV tier (only when there is one): vLLM's name for prefix hits from outside the pool, then
# the tier's own traffic and occupancy
TIER_COUNTERS = (
    ("external_prefix_cache_hits", "tier_hit_tokens",
     "Prompt tokens loaded from the KV tier instead of computed."),
    ("kv_tier_blocks_loaded", "tier_blocks_loaded", "KV blocks loaded from the tier."),
    ("kv_tier_bytes_read", "tier_bytes_read", "Bytes read from the KV tier."),
    ("kv_tier_read_failures", "tier_read_failures",
     "KV tier records that could not be loaded (missing, corrupt): recomputed."),
    ("kv_tier_blocks_written", "tier_blocks_written", "KV blocks written to the tier."),
    ("kv_tier_bytes_written", "tier_bytes_written", "Bytes written to the KV tier."),
    ("kv_tier_write_errors", "tier_write_errors",
     "KV tier writes that failed (a full disk, an unreachable store)."),
    ("kv_tier_blocks_write_dropped", "tier_blocks_write_dropped",
     "KV blocks not written because the tier's writer was behind."),
    ("kv_tier_evictions", "tier_evictions", "KV tier records evicted to keep its bound."),
)
TIER_GAUGES = (
    ("kv_tier_bytes", "tier_bytes", "Bytes the KV tier holds."),
    ("kv_tier_blocks", "tier_blocks", "KV blocks the tier holds."),
    ("kv_tier_bytes_limit", "tier_bytes_limit", "The KV tier's size bound (0: the store's own)."),
    ("kv_tier_writes_pending", "tier_writes_pending", "KV blocks queued for the tier's writer."),
)
PER_POS = "spec_decode_num_accepted_tokens_per_pos"
RECENT = 4096  # latest latency observations kept for the dashboard
RECENT_WINDOW_S = 30.0


def build_1_2_5_buckets(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (vLLM's token-count buckets)."""
    buckets: list[int] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return tuple(buckets)
            buckets.append(m * scale)
        scale *= 10


class EngineStatsCollector(Collector):
    """Reads the engine's stats() snapshot on each scrape."""

    def __init__(self, stats: Callable[[], dict[str, int | float | str]], model_name: str) -> None:
        self.stats = stats
        self.labels = [model_name, ENGINE_INDEX]

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        g = GaugeMetricFamily(name, doc, labels=LABELS)
        g.add_metric(self.labels, value)
        return g

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        c = CounterMetricFamily(name, doc, labels=LABELS)
        c.add_metric(self.labels, value)
        return c

    def collect(self) -> Iterable[Metric]:
        s = self.stats()
        for prefix, gauges in ((VLLM, VLLM_GAUGES), (OCTAVO, OCTAVO_GAUGES)):
            for name, key, doc in gauges:
                yield self._gauge(prefix + name, doc, float(s.get(key, 0)))
        total = s.get("kv_blocks_total", 0) or 0
        yield self._gauge(VLLM + "kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent "
                          "usage.", s.get("kv_blocks_used", 0) / total if total else 0.0)
        for prefix, counters in ((VLLM, VLLM_COUNTERS), (OCTAVO, OCTAVO_COUNTERS)):
            for name, key, doc in counters:
                yield self._counter(prefix + name, doc, float(s.get(key, 0)))
        yield from self._tier(s)
        if "spec_decode_num_drafts" not in s:
            return
        for name, doc in SPEC_COUNTERS:
            yield self._counter(VLLM + name, doc, float(s[name]))
        c = CounterMetricFamily(VLLM + PER_POS, "Accepted tokens per draft position.",
                                labels=[*LABELS, "position"])
        for key, value in s.items():
            if key.startswith(PER_POS + "_"):
                c.add_metric([*self.labels, key[len(PER_POS) + 1:]], float(value))
        yield c


    def _tier(self, s: dict[str, int | float]) -> Iterable[Metric]:
        """The KV tier's metrics (only where there is one): its prefix hits under vLLM's name,
        its own traffic and occupancy under octavo's."""
        if "tier_hit_tokens" not in s:
            return
        for name, key, doc in TIER_COUNTERS:
            prefix = VLLM if name == "external_prefix_cache_hits" else OCTAVO
            yield self._counter(prefix + name, doc, float(s.get(key, 0)))
        for name, key, doc in TIER_GAUGES:
            yield self._gauge(OCTAVO + name, doc, float(s.get(key, 0)))
        r = SummaryMetricFamily(OCTAVO + "kv_tier_read_seconds",
                                "Time to read and check a prefix's KV tier blocks.",
                                labels=LABELS)
        r.add_metric(self.labels, count_value=float(s.get("tier_reads", 0)),
                     sum_value=float(s.get("tier_read_seconds", 0.0)))
        yield r


class ServerMetrics:
    """The app's registry and the per-request histograms (an OutputObserver)."""

    def __init__(self, model_name: str, stats: Callable[[], dict[str, int | float | str]], *,
                 max_model_len: int, cache_config: Mapping[str, object]) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self.registry.register(EngineStatsCollector(stats, model_name))
        labels = (model_name, ENGINE_INDEX)

        def hist(name: str, doc: str, buckets: Iterable[float]) -> Histogram:
            return Histogram(VLLM + name, doc, LABELS, buckets=tuple(buckets),
                             registry=self.registry).labels(*labels)

        tokens = build_1_2_5_buckets(max_model_len)
        self.ttft = hist("time_to_first_token_seconds",
                         "Histogram of time to first token in seconds.", TTFT_BUCKETS)
        self.itl = hist("inter_token_latency_seconds",
                        "Histogram of inter-token latency in seconds.", ITL_BUCKETS)
        # vLLM's older name of the same observations, still on many dashboards
        self.tpot = hist("time_per_output_token_seconds",
                         "Histogram of time per output token in seconds.", ITL_BUCKETS)
        self.request_tpot = hist("request_time_per_output_token_seconds",
                                 "Histogram of time_per_output_token_seconds per request.",
                                 ITL_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds",
                        "Histogram of e2e request latency in seconds.", REQUEST_BUCKETS)
        self.queue = hist("request_queue_time_seconds",
                          "Histogram of time spent in WAITING phase for request.",
                          REQUEST_BUCKETS)
        self.inference = hist("request_inference_time_seconds",
                              "Histogram of time spent in RUNNING phase for request.",
                              REQUEST_BUCKETS)
        self.prefill = hist("request_prefill_time_seconds",
                            "Histogram of time spent in PREFILL phase for request.",
                            REQUEST_BUCKETS)
        self.decode = hist("request_decode_time_seconds",
                           "Histogram of time spent in DECODE phase for request.",
                           REQUEST_BUCKETS)
        self.prompt_tokens = hist("request_prompt_tokens", "Number of prefill tokens processed.",
                                  tokens)
        self.generation_tokens = hist("request_generation_tokens",
                                      "Number of generation tokens processed.", tokens)
        self.iteration_tokens = hist("iteration_tokens_total",
                                     "Histogram of number of tokens per engine_step.",
                                     ITERATION_BUCKETS)
        self.success = Counter(VLLM + "request_success", "Count of successfully processed "
                               "requests.", [*LABELS, "finished_reason"], registry=self.registry)
        info = {**{k: str(v) for k, v in cache_config.items()}, "engine": ENGINE_INDEX}
        Gauge(VLLM + "cache_config_info", "Information of the LLMEngine CacheConfig",
              list(info), registry=self.registry).labels(**info).set(1)
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

    def on_step(self, num_tokens: int) -> None:
        """Engine thread: a step computed `num_tokens` tokens."""
        if num_tokens > 0:
            self.iteration_tokens.observe(num_tokens)

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
            self.tpot.observe(last - prev_token_time)
            self.recent["itl"].append((time.monotonic(), last - prev_token_time))
        if out.finished:
            self._finished(out)

    def _finished(self, out: RequestProgress) -> None:
        """vLLM's phases: queued (arrival to first scheduled), prefill (to the first token),
        decode (first to last token), inference (prefill and decode)."""
        m = out.metrics
        arrival, scheduled = m.get("arrival_time"), m.get("first_scheduled_time")
        first, last, done = (m.get("first_token_time"), m.get("last_token_time"),
                             m.get("finished_time"))
        if done is not None and arrival is not None:
            self.e2e.observe(max(done - arrival, 0.0))
        if scheduled is not None and arrival is not None:
            self.queue.observe(max(scheduled - arrival, 0.0))
        if scheduled is not None and first is not None and last is not None:
            self.prefill.observe(max(first - scheduled, 0.0))
            self.decode.observe(max(last - first, 0.0))
            self.inference.observe(max(last - scheduled, 0.0))
            if out.num_generation_tokens > 1:
                self.request_tpot.observe(max(last - first, 0.0)
                                          / (out.num_generation_tokens - 1))
        self.prompt_tokens.observe(out.num_prompt_tokens)
        self.generation_tokens.observe(out.num_generation_tokens)
        self.success.labels(self.model_name, ENGINE_INDEX, out.finish_reason or "abort").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
