"""Slow request bodies never starve the server: 4,096 connections that send a request head and
then trickle their body hold at most --max-pending-bodies requests (the longest waiting gets
503 as new ones come), every body not whole within --body-timeout gets 408, and meanwhile
/health and requests sent whole keep being answered."""

from __future__ import annotations

import contextlib
import selectors
import socket
import time
from collections import Counter

import httpx
import pytest

from tests.server.conftest import RunningServer, start_server, stop_server

NUM_SLOW = 4096
MAX_PENDING = 64
BODY_TIMEOUT = 3.0
HEAD = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{")


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    s = start_server(tiny_llama_dir, num_kv_blocks=32, max_pending_bodies=MAX_PENDING,
                     body_timeout=BODY_TIMEOUT)
    yield s
    stop_server(s)


def open_slow(s: RunningServer, n: int) -> list[socket.socket]:
    host, port = s.url.removeprefix("http://").split(":")
    socks = []
    for _ in range(n):
        sock = socket.create_connection((host, int(port)), timeout=10)
        sock.sendall(HEAD)  # a head and one byte of a 100-byte body
        socks.append(sock)
    return socks


def status_lines(socks: list[socket.socket], wait: float) -> list[bytes]:
    """The status line each socket got within `wait` seconds (b"" for none)."""
    got = {id(s): b"" for s in socks}
    deadline = time.monotonic() + wait
    with selectors.DefaultSelector() as sel:  # epoll: descriptors past 1024
        for sock in socks:
            sel.register(sock, selectors.EVENT_READ)
        left = len(socks)
        while left and time.monotonic() < deadline:
            for key, _ in sel.select(timeout=0.05):
                sock = key.fileobj
                try:
                    got[id(sock)] = sock.recv(64).split(b"\r\n", 1)[0]
                except OSError:
                    got[id(sock)] = b"closed"
                sel.unregister(sock)
                left -= 1
    return [got[id(s)] for s in socks]


def test_slow_bodies_from_4096_connections_never_starve_health(server):
    slow = open_slow(server, NUM_SLOW)
    try:
        # the server works through the burst (~1 ms a connection here), then answers: a slow
        # body holds no slot a probe or a whole request needs
        with httpx.Client(timeout=60) as client:
            for _ in range(3):
                assert client.get(f"{server.url}/health").status_code == 200
                r = client.post(f"{server.url}/v1/completions",
                                json={"prompt": "hi", "max_tokens": 2})
                assert r.status_code == 200, r.text
        for sock in slow:  # they trickle on, too slowly
            with contextlib.suppress(OSError):
                sock.sendall(b" ")
        lines = Counter(status_lines(slow, wait=BODY_TIMEOUT + 10))
        # all but the last MAX_PENDING were turned away as later ones came (a whole request
        # whose body came a moment after its head may have taken a place); those got 408
        timed_out = lines.pop(b"HTTP/1.1 408 Request Timeout", 0)
        assert MAX_PENDING - 3 <= timed_out <= MAX_PENDING, timed_out
        assert lines == {b"HTTP/1.1 503 Service Unavailable": NUM_SLOW - timed_out}, lines
        assert httpx.get(f"{server.url}/health").status_code == 200
    finally:
        for sock in slow:
            sock.close()
