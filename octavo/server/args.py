"""`octavo serve`'s own flags (the engine's come from octavo.cli.add_engine_args).

Kept free of heavy imports: the CLI builds every subcommand's parser at start-up.
"""

from __future__ import annotations

import argparse

DEFAULT_MAX_REQUEST_BODY_BYTES = 8 << 20
DEFAULT_MAX_WAITING_REQUESTS = 1024


def add_server_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server (vLLM's flag names)")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--api-key", default=None,
                   help="require `Authorization: Bearer KEY` (default: env OCTAVO_API_KEY; "
                   "/health and /metrics stay open)")
    g.add_argument("--served-model-name", nargs="+", default=None,
                   help="model name(s) the API answers to (default: --model as given, or the "
                   "embedded model's name)")
    g.add_argument("--max-waiting-requests", type=int, default=DEFAULT_MAX_WAITING_REQUESTS,
                   help="answer 503 while this many requests wait to be scheduled")
    g.add_argument("--max-request-body-bytes", type=int,
                   default=DEFAULT_MAX_REQUEST_BODY_BYTES, help="answer 413 above this size")
    g.add_argument("--uvicorn-log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug", "trace"])
