"""The KV tier's numbers in /metrics: vLLM's external prefix-cache hits, the tier's traffic,
occupancy and read latency, present only where the engine has a tier."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from octavo.server.metrics import ServerMetrics

TIER_STATS = {"tier_hit_tokens": 320, "tier_blocks_loaded": 20, "tier_bytes_read": 4096,
              "tier_read_failures": 1, "tier_blocks_written": 7, "tier_bytes_written": 2048,
              "tier_write_errors": 2, "tier_blocks_write_dropped": 0, "tier_evictions": 3,
              "tier_bytes": 1024, "tier_blocks": 4, "tier_bytes_limit": 1 << 30,
              "tier_writes_pending": 1, "tier_reads": 5, "tier_read_seconds": 0.25}


def scrape(stats: dict) -> dict[str, float]:
    text = ServerMetrics("m", lambda: stats, max_model_len=1024, cache_config={}).render().decode()
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}


def test_the_tier_is_in_the_metrics_when_there_is_one() -> None:
    got = scrape({"kv_blocks_total": 8, **TIER_STATS})
    assert got["vllm:external_prefix_cache_hits_total"] == 320
    assert got["octavo:kv_tier_bytes_written_total"] == 2048
    assert got["octavo:kv_tier_evictions_total"] == 3
    assert got["octavo:kv_tier_bytes"] == 1024 and got["octavo:kv_tier_blocks"] == 4
    assert got["octavo:kv_tier_read_seconds_count"] == 5
    assert got["octavo:kv_tier_read_seconds_sum"] == 0.25


def test_no_tier_no_tier_metrics() -> None:
    assert not [n for n in scrape({"kv_blocks_total": 8}) if "tier" in n or "external_prefix" in n]
