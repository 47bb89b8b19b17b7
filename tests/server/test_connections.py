"""Connection hardening: idle and half-open connections are closed after the header timeout,
past the connection cap the longest-waiting idle one makes room, so /health keeps answering,
and repeated log lines are written once per interval."""

from __future__ import annotations

import logging
import socket
import time

import httpx
import pytest

from octavo.server.connections import RateLimitedLog
from tests.server.conftest import RunningServer, start_server, stop_server


@pytest.fixture(scope="module")
def guarded(tiny_llama_dir):
    s = start_server(tiny_llama_dir, num_kv_blocks=32, header_timeout=1.5,
                     timeout_keep_alive=0.5, limit_concurrency=40)
    yield s
    stop_server(s)


def connect(s: RunningServer) -> socket.socket:
    host, port = s.url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=5)


def closed_by_server(sock: socket.socket, within: float) -> bool:
    sock.settimeout(within)
    try:
        return sock.recv(1024) == b""
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


def test_a_connection_that_never_sends_a_request_is_closed(guarded):
    silent, partial = connect(guarded), connect(guarded)
    partial.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # never finishes its head
    t0 = time.monotonic()
    assert closed_by_server(silent, 5) and closed_by_server(partial, 5)
    assert 1.0 < time.monotonic() - t0 < 4


def test_a_request_in_time_is_served_and_the_idle_connection_closed_after(guarded):
    sock = connect(guarded)
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    sock.settimeout(5)
    assert sock.recv(1024).startswith(b"HTTP/1.1 200")
    assert closed_by_server(sock, 5)  # keep-alive idle past its timeout


def test_idle_connections_past_the_cap_make_room_for_real_requests(guarded):
    old = [connect(guarded) for _ in range(100)]  # cap 40: kept while young
    time.sleep(0.4)  # old enough to be closed for room
    new = [connect(guarded) for _ in range(100)]  # each one in sends one old one out
    try:
        t0 = time.monotonic()
        for _ in range(5):
            r = httpx.get(f"{guarded.url}/health", timeout=2)
            assert r.status_code == 200
        assert time.monotonic() - t0 < 5
        time.sleep(0.1)
        assert sum(closed_by_server(s, 0.05) for s in old) == 100, "the oldest made room"
        assert sum(closed_by_server(s, 0.01) for s in new) < 100
    finally:
        for s in old + new:
            s.close()


def test_requests_in_flight_past_the_cap_get_503(tiny_llama_dir, monkeypatch):
    s = start_server(tiny_llama_dir, num_kv_blocks=64, limit_concurrency=2)
    s.slow_steps(monkeypatch, 0.01)  # else 2 x 200 tokens can end before the third request
    try:
        body = {"prompt": "x", "max_tokens": 200, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{s.url}/v1/completions", json=body, timeout=60) as a, \
                httpx.stream("POST", f"{s.url}/v1/completions", json=body, timeout=60) as b:
            assert a.status_code == b.status_code == 200
            r = httpx.get(f"{s.url}/health", timeout=5)
            assert r.status_code == 503 and "limit" in r.json()["error"]["message"]
        assert httpx.get(f"{s.url}/health", timeout=5).status_code == 200
    finally:
        stop_server(s)


def test_repeated_log_lines_are_rate_limited():
    log = logging.getLogger("octavo.test.ratelimit")
    flt = RateLimitedLog(interval_s=0.2)
    log.addFilter(flt)
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record)

    handler = Keep()
    log.addHandler(handler)
    log.propagate = False
    try:
        for _ in range(1000):
            log.error("socket.accept() out of system resource")
        assert len(records) == 1
        time.sleep(0.25)
        log.error("socket.accept() out of system resource")
        assert len(records) == 2 and "999 more like it" in records[1].getMessage()
        log.error("another message")
        assert len(records) == 3
    finally:
        log.removeHandler(handler)


def test_every_connection_gets_tcp_nodelay_whatever_socket_accepted_it(guarded):
    # The test servers listen on socket(AF_INET, SOCK_STREAM): proto 0, so asyncio leaves
    # TCP_NODELAY off on what it accepts, and each response after the first on a keep-alive
    # connection waited 40 ms for the client's delayed ACK (Nagle). The server sets it itself.
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    assert listener.proto == 0
    with httpx.Client() as client:
        for _ in range(3):  # keep-alive: one connection, several requests
            r = client.post(f"{guarded.url}/tokenize", json={"prompt": "hi"})
            assert r.status_code == 200, r.text
        states = [p.transport.get_extra_info("socket")
                  for p in guarded.server.server_state.connections]
        open_sockets = [s for s in states if s is not None and s.fileno() >= 0]
        assert open_sockets
        for s in open_sockets:
            assert s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1
    listener.close()


def test_no_delay_sets_the_option_on_an_accepted_socket():
    from octavo.server.connections import no_delay

    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    client = socket.create_connection(listener.getsockname())
    accepted, _ = listener.accept()
    try:
        assert accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 0

        class Transport:
            def get_extra_info(self, name):
                return accepted if name == "socket" else None

        no_delay(Transport())
        assert accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1
    finally:
        for s in (accepted, client, listener):
            s.close()


def test_a_host_header_naming_another_site_is_refused_on_loopback(tiny_server):
    """DNS rebinding: a page on evil.example whose name now points at 127.0.0.1 reaches the
    port, but its requests carry its own name as Host."""
    for host, status in (("evil.example", 400), ("evil.example:8000", 400),
                         ("localhost:1234", 200), ("127.0.0.1", 200), ("[::1]:80", 200)):
        for path in ("/health", "/v1/models"):
            r = httpx.get(f"{tiny_server.url}{path}", headers={"Host": host})
            assert r.status_code == status, (host, path, r.text)
    r = httpx.get(f"{tiny_server.url}/v1/models", headers={"Host": "evil.example"})
    assert "--allowed-hosts" in r.json()["error"]["message"]
