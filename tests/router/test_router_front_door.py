"""The router has the server's front door: its API key on every route but /health (and
/metrics with --protect-metrics), the body and prompt bounds (a prompt that cannot fit, a
reserved template kwarg, a request's own template are refused by the router itself, without
holding up other traffic), and it ends requests on a replica that dies or hangs with an error
rather than a silent cut or an endless wait."""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from tests.router.conftest import (
    API_KEY,
    REPLICA_ENGINE,
    RunningRouter,
    start_router,
    stop_router,
)
from tests.server.conftest import start_server, stop_server

AUTH = {"Authorization": f"Bearer {API_KEY}"}
GET_PATHS = ["/metrics", "/v1/models", "/version", "/v1/responses/resp_x"]
POST_PATHS = ["/v1/completions", "/v1/chat/completions", "/v1/messages", "/v1/responses",
              "/v1/messages/count_tokens", "/tokenize", "/detokenize"]


@pytest.fixture(scope="module")
def keyed(tiny_llama_dir) -> Iterator[RunningRouter]:
    replica = start_server(tiny_llama_dir, **REPLICA_ENGINE)
    router = None
    try:
        router = start_router(tiny_llama_dir, [replica], api_key=API_KEY, protect_metrics=True)
        router.wait_healthy(1)
        yield router
    finally:
        if router is not None:
            stop_router(router)
        stop_server(replica)


def test_without_the_key_every_route_but_health_is_401(keyed: RunningRouter):
    for path in GET_PATHS:
        assert httpx.get(keyed.url + path).status_code == 401, path
    for path in POST_PATHS:
        r = httpx.post(keyed.url + path, json={"prompt": "x", "messages": [], "tokens": []})
        assert r.status_code == 401, path
    assert httpx.get(f"{keyed.url}/health").status_code == 200
    assert httpx.get(f"{keyed.url}/metrics", headers=AUTH).status_code == 200
    assert httpx.get(f"{keyed.url}/v1/models", headers=AUTH).status_code == 200


def test_a_6mb_prompt_is_refused_by_the_router_without_stalling_other_traffic(
        keyed: RunningRouter):
    huge = json.dumps({"prompt": "x" * (6 << 20), "max_tokens": 1}).encode()
    answers: list[httpx.Response] = []

    def send_huge() -> None:
        with httpx.Client(timeout=60) as client:
            for _ in range(3):
                answers.append(client.post(f"{keyed.url}/v1/completions", content=huge,
                                           headers={**AUTH, "Content-Type": "application/json"}))

    sender = threading.Thread(target=send_huge)
    sender.start()
    small = []
    with httpx.Client(timeout=60, headers=AUTH) as client:
        while sender.is_alive() or len(small) < 3:
            small.append(client.post(f"{keyed.url}/v1/completions",
                                     json={"prompt": "hi", "max_tokens": 2}).status_code)
    sender.join()
    assert small and set(small) == {200}
    for r in answers:
        assert r.status_code == 400, r.text[:300]
        assert "characters" in r.json()["error"]["message"]
        assert "x-octavo-replica" not in r.headers  # answered by the router itself


def test_reserved_kwargs_and_request_templates_are_refused_by_the_router(
        keyed: RunningRouter):
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    for extra, word in (({"chat_template_kwargs": {"tokenize": False}}, "tokenize"),
                        ({"chat_template": "{{ 'x' }}"}, "--trust-request-chat-template")):
        r = httpx.post(f"{keyed.url}/v1/chat/completions", headers=AUTH, json={**chat, **extra})
        assert r.status_code == 400 and word in r.json()["error"]["message"], r.text
        assert "x-octavo-replica" not in r.headers
    deep = "[" * 1000 + "]" * 1000
    r = httpx.post(f"{keyed.url}/v1/completions", headers={**AUTH, "Content-Type":
                                                           "application/json"},
                   content=f'{{"prompt": {deep}}}'.encode())
    assert r.status_code == 400 and "nested" in r.text


def test_aborted_uploads_leave_no_traceback_in_the_log(keyed: RunningRouter, caplog):
    host, port = keyed.url.removeprefix("http://").split(":")
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer "
            f"{API_KEY}\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
            '{"prompt": "').encode()
    with caplog.at_level(logging.INFO):
        for _ in range(50):
            with socket.create_connection((host, int(port)), timeout=5) as sock:
                sock.sendall(head)  # and leave, the body unfinished
        assert httpx.get(f"{keyed.url}/health").status_code == 200
        time.sleep(0.2)
    assert not [r.getMessage() for r in caplog.records if r.exc_info]
    assert len([r for r in caplog.records if r.levelno >= logging.WARNING]) <= 1


# ---- a replica that dies or hangs mid-stream ---------------------------------------------------
class FakeReplica(ThreadingHTTPServer):
    """Answers /health and /v1/models; a POST gets one SSE event, then the connection is cut
    (mode "die") or nothing more comes and /health stops answering too (mode "hang")."""

    daemon_threads = True
    mode = "die"

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), FakeHandler)
        self.release = threading.Event()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class FakeHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: FakeReplica

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        if self.server.mode == "hang":
            self.server.release.wait(30)
        body = b'{"data": [{"max_model_len": 512}]}' if self.path == "/v1/models" else b""
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        event = b'data: {"id": "x", "choices": [{"index": 0, "text": "a"}]}\n\n'
        self.wfile.write(b"%x\r\n%s\r\n" % (len(event), event))
        self.wfile.write(b"%x\r\n%s\r\n" % (6, b"data: "))  # half of the next event
        self.wfile.flush()
        if self.server.mode == "hang":
            self.server.release.wait(30)
        self.close_connection = True  # no last chunk: the body is cut


@pytest.fixture
def fake(tiny_llama_dir) -> Iterator[tuple[FakeReplica, RunningRouter]]:
    replica = FakeReplica()
    threading.Thread(target=replica.serve_forever, daemon=True).start()
    router = start_router(tiny_llama_dir, [], urls=[replica.url],
                          replica_timeout=1.0)
    try:
        router.wait_healthy(1)
        yield replica, router
    finally:
        replica.release.set()
        stop_router(router)
        replica.shutdown()


def stream_events(router: RunningRouter) -> list[str]:
    with httpx.stream("POST", f"{router.url}/v1/completions", timeout=30,
                      json={"prompt": "hi", "max_tokens": 5, "stream": True}) as r:
        assert r.status_code == 200
        return [line for line in r.iter_lines() if line]


@pytest.mark.parametrize("mode", ["die", "hang"])
def test_a_stream_cut_by_its_replica_ends_with_an_error_event(fake, mode):
    replica, router = fake
    replica.mode = mode
    t0 = time.monotonic()
    events = stream_events(router)
    assert time.monotonic() - t0 < 20
    assert events[0].startswith('data: {"id": "x"')  # whole events only: the half is dropped
    error = json.loads(events[-2].removeprefix("data: "))["error"]
    assert error["code"] == 502 and "replica 0" in error["message"], events
    assert events[-1] == "data: [DONE]" and len(events) == 3, events
