"""Real servers on free loopback ports, run by uvicorn on a thread of the test process.

Each fixture builds its own engine and app (a dedicated metrics registry per app), so servers
with different settings live side by side. The tiny random-weight Llama keeps them fast; one
server runs the embedded SmolLM2 so chat answers are real text.
"""

from __future__ import annotations

import dataclasses
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from octavo.bench.server_proc import parse_metrics
from octavo.engine.async_engine import AsyncLLMEngine
from octavo.engine.engine_thread import EngineThread
from octavo.llm import LLM
from octavo.server.args import ServerConfig
from octavo.server.launcher import OctavoServer, serve_app

API_KEY = "test-key-123"


@dataclass
class RunningServer:
    url: str
    engine: AsyncLLMEngine
    server: OctavoServer
    thread: threading.Thread
    model: str

    @property
    def v1(self) -> str:
        return f"{self.url}/v1"

    def slow_steps(self, monkeypatch: pytest.MonkeyPatch, seconds: float) -> None:
        """Sleep `seconds` before each engine step, for tests that need requests in flight
        (the tiny model can finish hundreds of tokens before a client's next call)."""
        engine = self.engine.engine
        real_step = engine.step

        def slow_step():
            time.sleep(seconds)
            return real_step()

        monkeypatch.setattr(engine, "step", slow_step)

    def metrics(self) -> dict[str, float]:
        """The server's /metrics as {name: value}, labels dropped (one model per server)."""
        return parse_metrics(httpx.get(f"{self.url}/metrics").text)

    def wait_idle(self, timeout: float = 10.0) -> dict[str, float]:
        """Poll /metrics until no request runs or waits and no KV block is held."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            idle = (m["vllm:num_requests_running"] == 0
                    and m["vllm:num_requests_waiting"] == 0
                    and m["octavo:kv_blocks_used"] == 0)
            if idle or time.monotonic() > deadline:
                return m
            time.sleep(0.05)


SERVER_OPTIONS = {f.name for f in dataclasses.fields(ServerConfig)}


def start_server(model_dir: Path, *, name: str = "tiny", **options) -> RunningServer:
    """`options`: ServerConfig fields for the server (tests default to a 1 MiB body limit),
    the rest EngineArgs for its engine."""
    server = {"max_request_body_bytes": 1 << 20,
              **{k: v for k, v in options.items() if k in SERVER_OPTIONS}}
    thread = EngineThread()  # builds the model and steps it, as `octavo serve` does
    llm = thread.call(LLM, model=str(model_dir), **{k: v for k, v in options.items()
                                                     if k not in SERVER_OPTIONS})
    server = serve_app(llm, ServerConfig(served_model_names=[name], **server), thread,
                       log_level="warning")
    engine = server.engine
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    return RunningServer(f"http://127.0.0.1:{port}", engine, server, thread, name)


def stop_server(s: RunningServer) -> None:
    s.engine.begin_shutdown()
    s.server.should_exit = True
    s.thread.join(timeout=30)
    assert not s.thread.is_alive(), "the test server did not stop"
    assert not s.engine.is_running, "the engine thread outlived its server"


TINY_ENGINE = dict(num_kv_blocks=2048, block_size=16, max_num_seqs=256)


@pytest.fixture(scope="session")
def tiny_server(tiny_llama_dir) -> Iterator[RunningServer]:
    s = start_server(tiny_llama_dir, **TINY_ENGINE)
    yield s
    stop_server(s)


@pytest.fixture(scope="session")
def auth_server(tiny_llama_dir) -> Iterator[RunningServer]:
    s = start_server(tiny_llama_dir, api_key=API_KEY, num_kv_blocks=64)
    yield s
    stop_server(s)


@pytest.fixture(scope="session")
def limits_server(tiny_llama_dir) -> Iterator[RunningServer]:
    """Tiny limits: every generation is refused (nothing may wait), bodies over 1 KiB too."""
    s = start_server(tiny_llama_dir, max_waiting_requests=0, max_request_body_bytes=1024,
                     num_kv_blocks=64)
    yield s
    stop_server(s)


@pytest.fixture(scope="module")
def smol_server(default_model_dir) -> Iterator[RunningServer]:
    s = start_server(default_model_dir, name="smollm2", num_kv_blocks=128, max_model_len=2048)
    yield s
    stop_server(s)
