"""`octavo router`: load the replicas' tokenizer, build the app, run uvicorn until a signal.

The first SIGTERM/SIGINT stops taking connections and lets the requests in flight finish (up
to `shutdown_timeout` seconds); the router then exits 0 (uvicorn alone would re-raise the
signal). `octavo serve --data-parallel-size N` runs the same server, with hooks to signal its
replicas and to watch their processes (data_parallel.py).
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Callable, Generator
from types import FrameType

import uvicorn

from octavo.model.sources import resolve_model_dir
from octavo.router.app import build_app
from octavo.router.args import RouterConfig
from octavo.router.prompts import PromptHasher, load_tokenizer
from octavo.server.connections import uvicorn_config

HANDLED_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def make_hasher(config: RouterConfig) -> PromptHasher:
    """The replicas' tokenizer (their model directory, resolved as `octavo serve` does)."""
    tokenizer = load_tokenizer(resolve_model_dir(config.model))
    return PromptHasher(tokenizer, config.block_size,
                        enable_auto_tool_choice=config.enable_auto_tool_choice,
                        tool_call_parser=config.tool_call_parser,
                        max_model_len=config.max_model_len,
                        chat_template_timeout=config.chat_template_timeout,
                        trust_request_chat_template=config.trust_request_chat_template)


class RouterServer(uvicorn.Server):
    """uvicorn.Server that exits 0 on a signal, calls `on_signal` on the first one, and calls
    `on_tick(self)` on its loop every tick (0.1 s) once started."""

    def __init__(self, config: uvicorn.Config,
                 on_signal: Callable[[], None] | None = None,
                 on_tick: Callable[[RouterServer], None] | None = None) -> None:
        super().__init__(config)
        self.on_signal = on_signal
        self.tick = on_tick
        self.exit_code = 0

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if not self.should_exit and self.on_signal is not None:
            self.on_signal()
        super().handle_exit(sig, frame)

    async def on_tick(self, counter: int) -> bool:
        if self.tick is not None and self.started and not self.should_exit:
            self.tick(self)
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


def router_server(config: RouterConfig, hasher: PromptHasher | None = None, **uvicorn_options
                  ) -> RouterServer:
    """The router's server, not started (`uvicorn_options`: host, port, log_level, ...)."""
    app = build_app(config, hasher if hasher is not None else make_hasher(config))
    ucfg = uvicorn_config(app, config, **uvicorn_options)
    ucfg.timeout_graceful_shutdown = int(config.shutdown_timeout)
    return RouterServer(ucfg)


def run_router(config: RouterConfig, host: str, port: int, log_level: str = "info") -> int:
    server = router_server(config, host=host, port=port, log_level=log_level)
    print(f"octavo router: {len(config.replicas)} replicas ({', '.join(config.replicas)}), "
          f"policy {config.policy}, on http://{host}:{port}", file=sys.stderr, flush=True)
    server.run()
    return server.exit_code
