"""/metrics as vLLM's tooling reads it: parsed by prometheus-client, vLLM's metric names, types,
label sets and histograms, and octavo's own paging gauges beside them."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.server.conftest import RunningServer

VLLM_GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting",
               "vllm:kv_cache_usage_perc")
VLLM_COUNTERS = ("vllm:prompt_tokens", "vllm:generation_tokens", "vllm:prefix_cache_queries",
                 "vllm:prefix_cache_hits", "vllm:num_preemptions", "vllm:request_success")
VLLM_HISTOGRAMS = (
    "vllm:request_prompt_tokens", "vllm:request_generation_tokens",
    "vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
    "vllm:time_per_output_token_seconds", "vllm:request_time_per_output_token_seconds",
    "vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds",
    "vllm:request_prefill_time_seconds", "vllm:request_decode_time_seconds",
    "vllm:request_inference_time_seconds", "vllm:iteration_tokens_total",
)


def test_vllm_metric_names_types_and_labels(tiny_server: RunningServer) -> None:
    r = httpx.post(f"{tiny_server.v1}/completions", timeout=60,
                   json={"prompt": "metrics", "max_tokens": 5, "ignore_eos": True})
    assert r.status_code == 200
    tiny_server.wait_idle()
    families = {f.name: f for f in text_string_to_metric_families(
        httpx.get(f"{tiny_server.url}/metrics").text)}
    expected = [(n, "gauge") for n in VLLM_GAUGES] + [(n, "counter") for n in VLLM_COUNTERS] \
        + [(n, "histogram") for n in VLLM_HISTOGRAMS]
    for name, kind in expected:
        assert name in families and families[name].type == kind, name
        for sample in families[name].samples:
            labels = set(sample.labels) - {"le", "finished_reason"}
            assert labels == {"model_name", "engine"}, (name, sample)
            assert sample.labels["model_name"] == "tiny" and sample.labels["engine"] == "0"

    def value(name: str, suffix: str = "") -> float:
        return sum(s.value for s in families[name].samples if s.name == name + suffix)

    for name in ("vllm:request_prompt_tokens", "vllm:request_generation_tokens",
                 "vllm:e2e_request_latency_seconds", "vllm:request_prefill_time_seconds",
                 "vllm:request_decode_time_seconds", "vllm:iteration_tokens_total"):
        assert value(name, "_count") >= 1, name
        buckets = [s for s in families[name].samples if s.name == name + "_bucket"]
        assert buckets[-1].labels["le"] == "+Inf" and buckets[-1].value == value(name, "_count")
    # the last request: 5 generated tokens (ignore_eos), in the +Inf and the le="5" buckets
    generated = {s.labels["le"]: s.value for s in families["vllm:request_generation_tokens"]
                 .samples if s.name.endswith("_bucket")}
    assert generated["5.0"] >= 1 and generated["2.0"] < generated["5.0"]
    assert value("vllm:generation_tokens", "_total") >= 5
    success = {s.labels["finished_reason"]: s.value
               for s in families["vllm:request_success"].samples if s.name.endswith("_total")}
    assert success.get("length", 0) >= 1
    (info,) = families["vllm:cache_config_info"].samples
    assert info.value == 1 and info.labels["block_size"] == "16"
    assert info.labels["num_gpu_blocks"] == "2048" and info.labels["engine"] == "0"
    # what vLLM has no name for stays octavo's (the router reads kv_blocks_total)
    assert value("octavo:kv_blocks_total") == 2048
    assert "octavo:kv_slots_internal_waste" in families
    assert not any(n.startswith("octavo:") for n in (*VLLM_GAUGES, *VLLM_COUNTERS))
