"""Two real replicas (`octavo serve`'s app on the tiny random Llama, each on a free loopback
port, as tests/server/conftest.py runs them) and the router in front, on a thread of the test
process. Every server is stopped by the fixture that started it."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from octavo.bench.server_proc import parse_metrics
from octavo.router.args import RouterConfig
from octavo.router.launcher import RouterServer, router_server
from tests.server.conftest import RunningServer, start_server, stop_server

API_KEY = "router-key-1"
REPLICA_ENGINE = dict(num_kv_blocks=256, block_size=16, max_num_seqs=32, api_key=API_KEY)


@dataclass
class RunningRouter:
    url: str
    server: RouterServer
    thread: threading.Thread
    replicas: list[RunningServer]

    @property
    def state(self):  # the app's Router: replicas, dispatcher, metrics
        return self.server.config.app.state.router

    def health(self) -> httpx.Response:
        return httpx.get(f"{self.url}/health")

    def metrics(self) -> str:
        return httpx.get(f"{self.url}/metrics").text

    def series(self, name: str, replica: int) -> float:
        """One router metric's value for one replica (summed over its other labels)."""
        url = self.replicas[replica].url
        total = 0.0
        for line in self.metrics().splitlines():
            if line.startswith(name + "{") and f'replica="{url}"' in line:
                total += float(line.rsplit(" ", 1)[1])
        return total

    def wait_healthy(self, n: int, timeout: float = 30) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            body = self.health().json()
            if body["healthy_replicas"] == n or time.monotonic() > deadline:
                return body
            time.sleep(0.05)


def replica_metrics(replica: RunningServer) -> dict[str, float]:
    return parse_metrics(httpx.get(f"{replica.url}/metrics").text)


def start_router(model_dir: Path, replicas: list[RunningServer],
                 urls: list[str] | None = None, **options) -> RunningRouter:
    """`urls`: replicas that are not RunningServers (a fake one), after `replicas`."""
    config = RouterConfig(replicas=[r.url for r in replicas] + (urls or []),
                          model=str(model_dir),
                          **{"block_size": 16, "health_interval": 0.2, **options})
    server = router_server(config, log_level="warning")
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test router did not start")
        time.sleep(0.02)
    return RunningRouter(f"http://127.0.0.1:{port}", server, thread, replicas)


def stop_router(r: RunningRouter) -> None:
    r.server.should_exit = True
    r.thread.join(timeout=30)
    assert not r.thread.is_alive(), "the test router did not stop"


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir) -> Iterator[RunningRouter]:
    replicas: list[RunningServer] = []
    router = None
    try:
        for _ in range(2):
            replicas.append(start_server(tiny_llama_dir, **REPLICA_ENGINE))
        router = start_router(tiny_llama_dir, replicas)
        router.wait_healthy(2)
        yield router
    finally:
        if router is not None:
            stop_router(router)
        for s in replicas:
            stop_server(s)
