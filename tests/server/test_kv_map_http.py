"""GET /v1/kv_map, its SSE stream and the dashboard's API-key handling, over real HTTP."""

from __future__ import annotations

import json
import logging
import threading
import time

import httpx
import pytest

from octavo.server.dashboard import KVMapSnapshot
from tests.server.conftest import API_KEY, start_server, stop_server


@pytest.fixture(scope="module")
def map_server(tiny_llama_dir):
    s = start_server(tiny_llama_dir, num_kv_blocks=128, block_size=16, max_num_seqs=16)
    yield s
    stop_server(s)


def generate(server, **body) -> None:
    r = httpx.post(f"{server.v1}/completions", timeout=60, json={
        "model": server.model, "prompt": "paging " * 8, "max_tokens": 300, "ignore_eos": True,
        **body})
    r.raise_for_status()


def test_snapshot_is_documented_and_matches_the_metrics(map_server):
    snap = httpx.get(f"{map_server.url}/v1/kv_map").json()
    KVMapSnapshot.model_validate(snap)  # the OpenAPI document's schema describes it
    assert snap["device"]["num_blocks"] == len(snap["device"]["states"]) == 128
    assert snap["contiguous"]["reserve"] == "request"
    again = httpx.get(f"{map_server.url}/v1/kv_map").json()
    assert again["cost"]["snapshots"] == snap["cost"]["snapshots"] + 1
    assert again["cost"]["seconds"] > snap["cost"]["seconds"] > 0
    assert again["cost"]["encode_seconds"] > snap["cost"]["encode_seconds"] >= 0
    assert httpx.get(f"{map_server.url}/v1/kv_map?contiguous=none").json()["contiguous"] is None
    doc = httpx.get(f"{map_server.url}/openapi.json").json()
    assert "/v1/kv_map" in doc["paths"] and "/dashboard" not in doc["paths"]
    bad = httpx.get(f"{map_server.url}/v1/kv_map?contiguous=sometimes")
    assert bad.status_code == 400 and "contiguous" in bad.json()["error"]["message"]
    bad = httpx.get(f"{map_server.url}/v1/kv_map/stream?hz=500")
    assert bad.status_code == 400 and "hz" in bad.json()["error"]["message"]
    missing = httpx.get(f"{map_server.url}/v1/kv_map/requests/nobody")
    assert missing.status_code == 404 and "nobody" in missing.json()["error"]["message"]
    block = httpx.get(f"{map_server.url}/v1/kv_map/blocks/3?pool=device").json()
    assert block["block_id"] == 3 and block["pool"] == "device"
    bad = httpx.get(f"{map_server.url}/v1/kv_map/blocks/128")
    assert bad.status_code == 400 and "not in the device pool" in bad.json()["error"]["message"]


def test_the_stream_shows_an_n4_request_sharing_blocks_then_caching_them(map_server):
    worker = threading.Thread(target=generate, args=(map_server,), kwargs={"n": 4})
    shared_seen = []
    with httpx.stream("GET", f"{map_server.url}/v1/kv_map/stream?hz=20", timeout=30) as s:
        assert s.headers["content-type"].startswith("text/event-stream")
        worker.start()
        for line in s.iter_lines():
            if not line.startswith("data: "):
                continue
            snap = json.loads(line[len("data: "):])
            if snap["device"]["counts"]["shared"]:
                shared_seen.append(snap)
            if not worker.is_alive() and not snap["requests"]:
                break
    worker.join()
    assert shared_seen, "no snapshot showed the n=4 request's shared prompt blocks"
    first = shared_seen[0]
    refs = first["device"]["shared_ref_cnt"]
    assert refs and set(refs[1::2]) == {4}  # the prompt's blocks, one reference per sample
    (request,) = first["requests"]
    assert request["n"] == 4 and len(request["seqs"]) == 4
    assert all("block_tables" not in q for q in request["seqs"])
    assert first["contiguous"]["slots"]["kv_slots_live"] > first["stats"]["kv_slots_live"]
    after = httpx.get(f"{map_server.url}/v1/kv_map").json()
    assert after["device"]["counts"]["cached"] == after["stats"]["kv_blocks_cached_free"] > 0
    assert after["device"]["counts"]["used"] == 0
    assert after["latency"]["ttft_count"] >= 1 and after["latency"]["itl_p50_s"] > 0


def test_an_open_stream_does_not_hold_up_shutdown(tiny_llama_dir):
    s = start_server(tiny_llama_dir, num_kv_blocks=32)
    got = []

    def read() -> None:
        with httpx.stream("GET", f"{s.url}/v1/kv_map/stream?hz=10", timeout=30) as r:
            got.extend(line for line in r.iter_lines() if line.startswith("data: "))

    reader = threading.Thread(target=read)
    reader.start()
    time.sleep(0.5)
    t0 = time.monotonic()
    stop_server(s)  # asserts the server thread ended
    reader.join(timeout=10)
    assert not reader.is_alive() and got
    assert time.monotonic() - t0 < 10


@pytest.fixture(scope="module")
def key_server(tiny_llama_dir):
    s = start_server(tiny_llama_dir, api_key=API_KEY, num_kv_blocks=32)
    yield s
    stop_server(s)


def test_the_api_key_protects_the_map_and_the_page(key_server):
    url = key_server.url
    for path in ("/v1/kv_map", "/dashboard", "/v1/kv_map/stream", "/v1/kv_map/blocks/0",
                 "/v1/kv_map/requests/x"):
        r = httpx.get(url + path)
        assert r.status_code == 401 and "/dashboard?api_key=KEY" in r.json()["error"]["message"]
    ok = httpx.get(f"{url}/v1/kv_map", headers={"Authorization": f"Bearer {API_KEY}"})
    assert ok.status_code == 200
    assert httpx.get(f"{url}/dashboard?api_key=wrong").status_code == 401
    login = httpx.get(f"{url}/dashboard?api_key={API_KEY}")
    assert login.status_code == 303 and login.headers["location"] == "/dashboard"
    cookie = login.headers["set-cookie"]
    assert "HttpOnly" in cookie and "SameSite=Strict" in cookie and "Secure" not in cookie
    # the cookie holds a random session token, never the key
    assert API_KEY not in cookie
    token = login.cookies["octavo_session"]
    assert len(token) >= 32 and httpx.get(f"{url}/dashboard?api_key={API_KEY}").cookies[
        "octavo_session"] != token
    # the key itself as a cookie opens nothing
    for name in ("octavo_session", "octavo_api_key"):
        assert httpx.get(f"{url}/dashboard", cookies={name: API_KEY}).status_code == 401
    jar = httpx.Cookies({"octavo_session": token})
    assert httpx.get(f"{url}/dashboard", cookies=jar).status_code == 200
    assert httpx.get(f"{url}/v1/kv_map", cookies=jar).status_code == 200
    assert httpx.get(f"{url}/v1/kv_map/blocks/0", cookies=jar).status_code == 200
    # the cookie opens the dashboard's own GETs, nothing else
    assert httpx.get(f"{url}/v1/models", cookies=jar).status_code == 401
    assert httpx.post(f"{url}/v1/completions", cookies=jar, json={
        "model": key_server.model, "prompt": "x", "max_tokens": 1}).status_code == 401
    bad = httpx.Cookies({"octavo_session": "wrong"})
    assert httpx.get(f"{url}/v1/kv_map", cookies=bad).status_code == 401
    # behind TLS (a proxy that says so) the cookie is Secure: never sent in the clear
    tls = httpx.get(f"{url}/dashboard?api_key={API_KEY}",
                    headers={"X-Forwarded-Proto": "https"})
    assert "Secure" in tls.headers["set-cookie"]


def test_the_login_key_never_reaches_the_access_log(key_server, caplog):
    """uvicorn logs each request's path and query from the ASGI scope: the middleware blanks
    `api_key` out of it before any response starts, right key or wrong."""
    access = logging.getLogger("uvicorn.access")
    level = access.level
    access.setLevel(logging.INFO)  # the test servers run at "warning"; new connections log
    try:
        with caplog.at_level(logging.INFO, logger="uvicorn.access"):
            for key in (API_KEY, "wrong-key-xyz"):
                with httpx.Client() as client:  # a fresh connection reads the level
                    client.get(f"{key_server.url}/dashboard?api_key={key}&x=1")
            deadline = time.monotonic() + 5
            while len(caplog.records) < 2 and time.monotonic() < deadline:
                time.sleep(0.02)
    finally:
        access.setLevel(level)
    lines = [r.getMessage() for r in caplog.records if r.name == "uvicorn.access"]
    assert len(lines) == 2 and all("/dashboard?api_key=redacted&x=1" in x for x in lines), lines
    assert not any(API_KEY in x or "wrong-key-xyz" in x for x in lines)
