"""`octavo serve`: load the engine, build the app, run uvicorn until SIGTERM/SIGINT.

Shutdown is a drain. The first SIGTERM/SIGINT stops admitting work: new requests and /health
get 503 (the listening socket stays open, so clients and load balancers get an answer), while
the requests in flight run on for up to `--shutdown-timeout` seconds. When none is left, or
the time is up, the rest are aborted (their streams end at once, blocks go back to the pool),
uvicorn closes the connections and `serve` returns 0; a second signal aborts at once. uvicorn
alone would re-raise the signal (dying by SIGTERM instead of exiting 0) and wait for every
stream with no limit.

The model is built on the engine thread that will step it (one OpenMP team per process: see
engine/engine_thread.py). If the engine thread dies, /health fails at once and `serve` exits 1,
so a supervisor restarts it; a failed model step only fails the requests of that step
(engine/async_engine.py).
"""

from __future__ import annotations

import contextlib
import logging
import signal
import sys
import threading
import time
from collections.abc import Callable, Generator

import uvicorn

from octavo.engine.async_engine import AsyncLLMEngine
from octavo.engine.engine_thread import EngineThread
from octavo.llm import LLM
from octavo.server.app import build_app
from octavo.server.args import ServerConfig, server_config  # noqa: F401 (re-exported)
from octavo.server.connections import uvicorn_config

logger = logging.getLogger(__name__)

HANDLED_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class OctavoServer(uvicorn.Server):
    """uvicorn.Server that drains on the first signal and exits 1 if the engine dies."""

    def __init__(self, config: uvicorn.Config, engine: AsyncLLMEngine,
                 shutdown_timeout: float) -> None:
        super().__init__(config)
        self.engine = engine
        self.shutdown_timeout = shutdown_timeout
        self.drain_deadline: float | None = None
        self.exit_code = 0

    @property
    def draining(self) -> bool:
        return self.drain_deadline is not None

    def handle_exit(self, sig: int, frame: object) -> None:  # type: ignore[override]
        if not self.draining:
            self.begin_drain()
        else:  # a second signal: stop waiting
            self.stop_now()

    def begin_drain(self) -> None:
        """Refuse new work; what is in flight may finish within the shutdown timeout."""
        self.drain_deadline = time.monotonic() + self.shutdown_timeout
        self.engine.begin_drain()  # a flag and a queue put: safe inside a signal handler

    def stop_now(self) -> None:
        self.engine.begin_shutdown()  # aborts whatever is still in flight
        self.should_exit = True

    async def on_tick(self, counter: int) -> bool:
        if self.draining and not self.should_exit and (
            self.engine.num_in_flight == 0 or time.monotonic() >= (self.drain_deadline or 0)
        ):
            left = self.engine.num_in_flight
            if left:
                logger.warning("shutdown timeout: aborting %d requests still in flight", left)
            self.stop_now()
        if self.started and not self.should_exit and not self.engine.is_running:
            logger.error("the engine thread is not running; exiting with status 1")
            self.exit_code = 1
            self.stop_now()
        return await super().on_tick(counter)

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in HANDLED_SIGNALS}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def serve_app(llm: LLM, config: ServerConfig, thread: EngineThread | None = None,
              **uvicorn_options) -> OctavoServer:
    """The app and its server, not started (run() it; tests run it on a thread). `thread`: the
    thread `llm` was built on, to step it on (engine/engine_thread.py says why)."""
    engine = AsyncLLMEngine(llm.engine, thread=thread)
    app = build_app(engine, config)
    return OctavoServer(uvicorn_config(app, config, **uvicorn_options), engine,
                        config.shutdown_timeout)


def run_server(llm: LLM, config: ServerConfig, host: str, port: int,
               log_level: str = "info", thread: EngineThread | None = None) -> int:
    server = serve_app(llm, config, thread, host=host, port=port, log_level=log_level)
    name = config.served_model_names[0] if config.served_model_names else llm.engine.model_dir.name
    auth = ' -H "Authorization: Bearer $OCTAVO_API_KEY"' if config.api_key else ""
    print(
        f"octavo: serving {name!r} (max_model_len {llm.engine.max_model_len}) on "
        f"http://{host}:{port}\ntry:\n  curl http://{host}:{port}"
        f"/v1/chat/completions -H 'Content-Type: application/json'{auth} -d "
        f"'{{\"model\": \"{name}\", \"messages\": [{{\"role\": \"user\", \"content\": "
        f"\"What is PagedAttention?\"}}], \"max_tokens\": 64}}'",
        file=sys.stderr, flush=True,
    )
    server.run()
    return server.exit_code


def build_and_serve(make_llm: Callable[[], LLM], config: ServerConfig, host: str, port: int,
                    log_level: str = "info") -> int:
    """Build the LLM on a new engine thread, then serve it, stepping it on that thread."""
    thread = EngineThread()
    llm = thread.call(make_llm)
    return run_server(llm, config, host, port, log_level, thread)
