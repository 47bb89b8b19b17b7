"""`octavo serve`: load the engine, build the app, run uvicorn until SIGTERM/SIGINT.

uvicorn's graceful shutdown waits for open responses to finish, which for a long stream could
be minutes, and afterwards re-raises the signal, so the process would die by SIGTERM instead of
exiting 0. OctavoServer changes both: on the signal it stops accepting (uvicorn) AND aborts
every request in flight (their streams end at once, blocks go back to the pool), then the
lifespan stops the engine thread and `serve` returns 0.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable, Generator
from pathlib import Path

import uvicorn

from octavo.engine.async_engine import AsyncLLMEngine
from octavo.llm import LLM
from octavo.server.app import build_app
from octavo.server.context import ServerConfig

HANDLED_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class OctavoServer(uvicorn.Server):
    """uvicorn.Server whose exit signal also aborts in-flight requests, with no re-raise."""

    def __init__(self, config: uvicorn.Config, on_exit: Callable[[], None]) -> None:
        super().__init__(config)
        self.on_exit = on_exit

    def handle_exit(self, sig: int, frame: object) -> None:  # type: ignore[override]
        super().handle_exit(sig, frame)  # type: ignore[arg-type]
        self.on_exit()  # queue.SimpleQueue.put: safe inside a signal handler

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


def read_api_key(args: argparse.Namespace) -> str | None:
    if args.api_key_file:
        try:
            lines = Path(args.api_key_file).read_text().splitlines()
        except OSError as e:
            raise ValueError(f"--api-key-file: cannot read {args.api_key_file}: {e}") from e
        key = lines[0].strip() if lines else ""
        if not key:
            raise ValueError(f"--api-key-file: {args.api_key_file} holds no key")
        return key
    return args.api_key or os.environ.get("OCTAVO_API_KEY") or None


def server_config(args: argparse.Namespace) -> ServerConfig:
    """The server's settings from its flags; call before loading the model (fail fast)."""
    key = read_api_key(args)
    if args.protect_metrics and not key:
        raise ValueError("--protect-metrics needs an API key (--api-key or --api-key-file)")
    return ServerConfig(
        # empty: the model directory's name (filled in by ServerContext)
        served_model_names=list(args.served_model_name or ([args.model] if args.model else [])),
        api_key=key,
        max_waiting_requests=args.max_waiting_requests,
        max_request_body_bytes=args.max_request_body_bytes,
        max_prompts_per_request=args.max_prompts_per_request,
        max_sequences_per_request=args.max_sequences_per_request,
        protect_metrics=args.protect_metrics,
        header_timeout=args.header_timeout,
        timeout_keep_alive=args.timeout_keep_alive,
        limit_concurrency=args.limit_concurrency,
        shutdown_timeout=args.shutdown_timeout,
    )


def run_server(llm: LLM, config: ServerConfig, host: str, port: int,
               log_level: str = "info") -> int:
    engine = AsyncLLMEngine(llm.engine)
    app = build_app(engine, config)
    uv_config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                               timeout_graceful_shutdown=5)
    server = OctavoServer(uv_config, on_exit=engine.begin_shutdown)
    name = config.served_model_names[0]
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
    return 0
