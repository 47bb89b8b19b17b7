"""The router end to end: two real replicas of the tiny model behind it, driven over HTTP."""

from __future__ import annotations

import json
import random
import time

import httpx
import pytest
from openai import OpenAI

from tests.router.conftest import (
    API_KEY,
    REPLICA_ENGINE,
    RunningRouter,
    replica_metrics,
    start_router,
    stop_router,
)
from tests.server.conftest import RunningServer, start_server, stop_server

AUTH = {"Authorization": f"Bearer {API_KEY}"}


def ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(32, 256) for _ in range(n)]


def complete(router: RunningRouter, prompt, max_tokens: int = 2, **extra) -> httpx.Response:
    r = httpx.post(f"{router.url}/v1/completions", headers=AUTH, timeout=60, json={
        "model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        **extra})
    assert r.status_code == 200, r.text
    return r


def test_a_streamed_and_a_plain_request_through_the_router(cluster: RunningRouter) -> None:
    client = OpenAI(base_url=f"{cluster.url}/v1", api_key=API_KEY)
    assert [m.id for m in client.models.list().data] == ["tiny"]
    out = client.completions.create(model="tiny", prompt="hello there", max_tokens=5,
                                    temperature=0, extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 5 and out.choices[0].finish_reason == "length"
    chunks = list(client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
        stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert chunks[-1].usage.completion_tokens == 4
    # a raw stream comes through as Server-Sent Events, and says what a replica would say
    body = {"model": "tiny", "prompt": "abc", "max_tokens": 6, "temperature": 0,
            "ignore_eos": True}
    with httpx.stream("POST", f"{cluster.url}/v1/completions", headers=AUTH,
                      json={**body, "stream": True}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["x-octavo-replica"] in ("0", "1")
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]"
    streamed = "".join(json.loads(ln[6:])["choices"][0]["text"] for ln in lines[:-1])
    direct = httpx.post(f"{cluster.replicas[0].url}/v1/completions", headers=AUTH, json=body)
    assert streamed == direct.json()["choices"][0]["text"]


def test_requests_sharing_a_prefix_land_on_one_replica_and_hit_its_cache(
        cluster: RunningRouter) -> None:
    prefix = ids(1, 64)  # four full blocks of 16
    before = [replica_metrics(r) for r in cluster.replicas]
    routed = [cluster.series("octavo:router_prefix_match_tokens_total", i) for i in (0, 1)]
    served = {complete(cluster, prefix + ids(100 + i, 8)).headers["x-octavo-replica"]
              for i in range(4)}
    assert len(served) == 1
    rid = int(served.pop())
    after = replica_metrics(cluster.replicas[rid])
    hits = (after["vllm:prefix_cache_hits_total"]
            - before[rid]["vllm:prefix_cache_hits_total"])
    assert hits == 3 * 64  # the three followers found the prefix's four blocks
    # the router's estimate is exactly the replica's count: its block hashes are the engine's
    match = cluster.series("octavo:router_prefix_match_tokens_total", rid) - routed[rid]
    assert match == hits
    # chat: the router renders the template as the replica does, so the same holds
    system = {"role": "system", "content": "You answer in French. " * 4}
    before_chat = [replica_metrics(r) for r in cluster.replicas]
    routed_chat = [cluster.series("octavo:router_prefix_match_tokens_total", i) for i in (0, 1)]
    ends = set()
    for q in ("one", "two", "three"):
        r = httpx.post(f"{cluster.url}/v1/chat/completions", headers=AUTH, json={
            "model": "tiny", "max_tokens": 1,
            "messages": [system, {"role": "user", "content": q}]})
        assert r.status_code == 200, r.text
        ends.add(r.headers["x-octavo-replica"])
    assert len(ends) == 1
    rid = int(ends.pop())
    hits = (replica_metrics(cluster.replicas[rid])["vllm:prefix_cache_hits_total"]
            - before_chat[rid]["vllm:prefix_cache_hits_total"])
    match = cluster.series("octavo:router_prefix_match_tokens_total", rid) - routed_chat[rid]
    assert hits == match >= 2 * 5 * 16  # two followers, the system prompt's 5+ blocks each


def test_a_prompt_that_cannot_be_rendered_is_routed_by_its_text(cluster: RunningRouter) -> None:
    hasher = cluster.state.hasher
    bad = {"model": "tiny", "messages": [{"role": "wizard", "content": "x" * 300}]}
    a = hasher.keys("/v1/chat/completions", json.dumps(bad).encode())
    b = hasher.keys("/v1/chat/completions", json.dumps({**bad, "max_tokens": 3}).encode())
    assert not a.exact and a.block_hashes and a.block_hashes == b.block_hashes
    good = hasher.keys("/v1/completions", json.dumps({"prompt": ids(5, 40)}).encode())
    assert good.exact and good.num_tokens == 40 and len(good.block_hashes) == 2
    # the replica refuses it, and the router passes the error on as it came
    r = httpx.post(f"{cluster.url}/v1/chat/completions", headers=AUTH, json=bad)
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("messages")


def test_health_and_metrics(cluster: RunningRouter) -> None:
    r = cluster.health()
    assert r.status_code == 200
    body = r.json()
    assert body["healthy_replicas"] == 2
    assert [s["url"] for s in body["replicas"]] == [s.url for s in cluster.replicas]
    # each replica's index is sized to its KV blocks, read from its /metrics
    assert all(s["healthy"] and s["kv_blocks"] == 256 == s["index_capacity"]
               for s in body["replicas"])
    complete(cluster, "metrics please")
    text = cluster.metrics()
    for name in ("octavo:router_requests_total", "octavo:router_requests_in_flight",
                 "octavo:router_prefix_match_tokens_total", "octavo:router_prompt_tokens_total",
                 "octavo:router_upstream_errors_total", "octavo:router_replica_healthy"):
        for s in cluster.replicas:
            assert any(line.startswith(name + "{") and s.url in line
                       for line in text.splitlines()), (name, s.url)
    assert sum(cluster.series("octavo:router_requests_total", i) for i in (0, 1)) >= 1
    assert sum(cluster.series("octavo:router_replica_healthy", i) for i in (0, 1)) == 2
    assert all(cluster.series("octavo:router_requests_in_flight", i) == 0 for i in (0, 1))


def test_keys_status_codes_and_error_bodies_pass_through(cluster: RunningRouter) -> None:
    body = {"model": "tiny", "prompt": "x", "max_tokens": 1}
    r = httpx.post(f"{cluster.url}/v1/completions", json=body)
    assert r.status_code == 401 and r.json()["error"]["code"] == 401
    r = httpx.post(f"{cluster.url}/v1/completions", headers=AUTH,
                   json={**body, "model": "nope"})
    assert r.status_code == 404 and "nope" in r.json()["error"]["message"]
    # Anthropic's Messages API with x-api-key; its errors as the replica words them
    msg = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    r = httpx.post(f"{cluster.url}/v1/messages", headers={"x-api-key": API_KEY}, json=msg)
    assert r.status_code == 200 and r.json()["type"] == "message"
    for bad in ({**msg, "max_tokens": -1}, {**msg, "messages": []}):
        r = httpx.post(f"{cluster.url}/v1/messages", headers={"x-api-key": API_KEY}, json=bad)
        direct = httpx.post(f"{cluster.replicas[1].url}/v1/messages",
                            headers={"x-api-key": API_KEY}, json=bad)
        assert r.status_code == direct.status_code == 400
        assert r.json() == direct.json() and r.json()["type"] == "error"
    r = httpx.post(f"{cluster.url}/tokenize", headers=AUTH, json={"prompt": "abc"})
    assert r.status_code == 200 and r.json()["count"] == 3
    r = httpx.post(f"{cluster.url}/v1/completions", headers=AUTH, content=b"x" * (9 << 20))
    assert r.status_code == 413 and r.json()["error"]["code"] == 413


def test_a_stored_response_is_found_on_its_replica(cluster: RunningRouter) -> None:
    first = httpx.post(f"{cluster.url}/v1/responses", headers=AUTH, json={
        "model": "tiny", "input": "hello", "max_output_tokens": 2})
    assert first.status_code == 200, first.text
    holder, rid = first.headers["x-octavo-replica"], first.json()["id"]
    for _ in range(3):  # whatever the policy would say, the next turn goes where it lives
        r = httpx.post(f"{cluster.url}/v1/responses", headers=AUTH, json={
            "model": "tiny", "input": "more", "max_output_tokens": 2,
            "previous_response_id": rid})
        assert r.status_code == 200, r.text
        assert r.headers["x-octavo-replica"] == holder
    got = httpx.get(f"{cluster.url}/v1/responses/{rid}", headers=AUTH)
    assert got.status_code == 200 and got.json()["id"] == rid
    assert httpx.delete(f"{cluster.url}/v1/responses/{rid}", headers=AUTH).status_code == 200
    gone = httpx.get(f"{cluster.url}/v1/responses/{rid}", headers=AUTH)
    assert gone.status_code == 404 and gone.json()["error"]["code"] == 404


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_disconnects_has_its_replica_request_aborted(
        cluster: RunningRouter, monkeypatch, stream: bool) -> None:
    # slow engine steps keep the request in flight when the client leaves
    for replica in cluster.replicas:
        engine = replica.engine.engine
        monkeypatch.setattr(engine, "step", lambda real=engine.step: (time.sleep(0.01), real())[1])
    before = [r.wait_idle() for r in cluster.replicas]
    body = {"model": "tiny", "prompt": ids(7, 32), "max_tokens": 400, "ignore_eos": True,
            "stream": stream}
    if stream:
        with httpx.stream("POST", f"{cluster.url}/v1/completions", headers=AUTH,
                          json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    break  # one chunk, then hang up
    else:  # nothing comes back before the end: the router must watch the connection
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{cluster.url}/v1/completions", headers=AUTH, json=body, timeout=0.5)
    after = [r.wait_idle() for r in cluster.replicas]
    generated = sum(a["vllm:generation_tokens_total"] - b["vllm:generation_tokens_total"]
                    for a, b in zip(after, before, strict=True))
    assert 0 < generated < 400  # started, and aborted before its end
    for a, b in zip(after, before, strict=True):
        assert a["vllm:num_requests_running"] == 0 and a["octavo:kv_blocks_used"] == 0
        assert (a.get("vllm:request_success_total", 0)
                == b.get("vllm:request_success_total", 0))
    # the router's own count of the request is gone too
    assert all(cluster.series("octavo:router_requests_in_flight", i) == 0 for i in (0, 1))


def test_a_killed_replica_is_reported_and_gets_no_traffic(tiny_llama_dir) -> None:
    replicas: list[RunningServer] = []
    router = None
    stopped = [False, False]
    try:
        for _ in range(2):
            replicas.append(start_server(tiny_llama_dir, **REPLICA_ENGINE))
        router = start_router(tiny_llama_dir, replicas, health_interval=60.0)  # only at start
        assert router.wait_healthy(2)["healthy_replicas"] == 2
        stop_server(replicas[0])
        stopped[0] = True
        # no health check has run since: the refused connection marks it down, and the
        # request goes to the other replica
        served = {complete(router, ids(i, 20)).headers["x-octavo-replica"] for i in range(4)}
        assert served == {"1"}
        body = router.health().json()
        assert router.health().status_code == 200 and body["healthy_replicas"] == 1
        assert [s["healthy"] for s in body["replicas"]] == [False, True]
        assert body["replicas"][0]["error"]
        assert router.series("octavo:router_upstream_errors_total", 0) == 1
        assert router.series("octavo:router_replica_healthy", 0) == 0
        stop_server(replicas[1])
        stopped[1] = True
        r = httpx.post(f"{router.url}/v1/completions", headers=AUTH,
                       json={"model": "tiny", "prompt": "x", "max_tokens": 1})
        assert r.status_code == 503 and "no healthy replica" in r.json()["error"]["message"]
        assert router.health().status_code == 503
    finally:
        if router is not None:
            stop_router(router)
        for s, done in zip(replicas, stopped, strict=False):
            if not done:
                stop_server(s)


def test_a_bad_configuration_is_refused() -> None:
    from octavo.cli import main
    from octavo.router.args import RouterConfig

    with pytest.raises(ValueError, match="at least one replica"):
        RouterConfig(replicas=[])
    with pytest.raises(ValueError, match="not an http"):
        RouterConfig(replicas=["127.0.0.1:8001"])
    with pytest.raises(ValueError, match="more than once"):
        RouterConfig(replicas=["http://a:1", "http://a:1/"])
    with pytest.raises(ValueError, match="block-size"):
        RouterConfig(replicas=["http://a:1"], block_size=7)
    assert main(["router", "--replica", "ftp://x"]) == 2
    assert main(["router"]) == 2
    assert main(["router", "--replica", "http://127.0.0.1:1", "--model", "/no/such/dir"]) == 2
    assert main(["serve", "--data-parallel-size", "0"]) == 2
