"""`octavo serve`'s own flags (the engine's come from octavo.cli.add_engine_args).

Kept free of heavy imports: the CLI builds every subcommand's parser at start-up.
"""

from __future__ import annotations

import argparse

DEFAULT_MAX_REQUEST_BODY_BYTES = 8 << 20
DEFAULT_MAX_WAITING_REQUESTS = 1024
DEFAULT_MAX_PROMPTS_PER_REQUEST = 128
DEFAULT_MAX_SEQUENCES_PER_REQUEST = 1024
DEFAULT_HEADER_TIMEOUT = 10.0
DEFAULT_TIMEOUT_KEEP_ALIVE = 5.0
DEFAULT_LIMIT_CONCURRENCY = 4096
DEFAULT_SHUTDOWN_TIMEOUT = 30.0
DEFAULT_MAX_STORED_RESPONSES = 1000


def add_server_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server (vLLM's flag names)")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--api-key", default=None,
                   help="require `Authorization: Bearer KEY` (default: env OCTAVO_API_KEY; "
                   "/health and /metrics stay open)")
    g.add_argument("--api-key-file", default=None,
                   help="read the API key from this file (first line), so it stays out of the "
                   "process list")
    g.add_argument("--protect-metrics", action="store_true",
                   help="/metrics needs the API key too")
    g.add_argument("--served-model-name", nargs="+", default=None,
                   help="model name(s) the API answers to (default: --model as given, or the "
                   "embedded model's name)")
    g.add_argument("--max-waiting-requests", type=int, default=DEFAULT_MAX_WAITING_REQUESTS,
                   help="answer 503 while this many requests wait to be scheduled")
    g.add_argument("--max-request-body-bytes", type=int,
                   default=DEFAULT_MAX_REQUEST_BODY_BYTES, help="answer 413 above this size")
    g.add_argument("--max-prompts-per-request", type=int,
                   default=DEFAULT_MAX_PROMPTS_PER_REQUEST,
                   help="answer 400 to a completion request with more prompts")
    g.add_argument("--max-sequences-per-request", type=int,
                   default=DEFAULT_MAX_SEQUENCES_PER_REQUEST,
                   help="answer 400 when prompts x n exceeds this")
    g.add_argument("--data-parallel-size", type=int, default=1,
                   help="run this many replicas of the server (child processes, each on a "
                   "free 127.0.0.1 port with its share of the cores) behind a prefix-aware "
                   "router on --host/--port (octavo/router; default: %(default)s)")
    a = p.add_argument_group("tools and reasoning (vLLM's flag names)")
    a.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="let the model decide when to call tools (tool_choice 'auto', the "
                   "default when a request has tools); needs --tool-call-parser")
    a.add_argument("--tool-call-parser", default=None,
                   choices=["hermes", "llama3_json", "mistral", "pythonic"],
                   help="how tool calls are read from the model's output (and taught to models "
                   "whose chat template does not render tools)")
    a.add_argument("--reasoning-parser", default=None, choices=["deepseek_r1", "qwen3"],
                   help="split <think>...</think> reasoning into reasoning_content")
    a.add_argument("--max-stored-responses", type=int, default=DEFAULT_MAX_STORED_RESPONSES,
                   help="responses kept in memory for previous_response_id (/v1/responses "
                   "with store=true); the oldest go first")
    c = p.add_argument_group("connections (uvicorn's names where it has one)")
    c.add_argument("--header-timeout", type=float, default=DEFAULT_HEADER_TIMEOUT,
                   help="close a connection that has not sent a whole request head this many "
                   "seconds after it opened (or after its last response)")
    c.add_argument("--timeout-keep-alive", type=float, default=DEFAULT_TIMEOUT_KEEP_ALIVE,
                   help="close an idle keep-alive connection after this many seconds")
    c.add_argument("--limit-concurrency", type=int, default=DEFAULT_LIMIT_CONCURRENCY,
                   help="open connections at most; past it the oldest connection still "
                   "waiting for its request head is closed, and requests get 503")
    c.add_argument("--shutdown-timeout", type=float, default=DEFAULT_SHUTDOWN_TIMEOUT,
                   help="on SIGTERM / SIGINT: refuse new requests (503) and let those in flight "
                   "finish for up to this many seconds, then abort the rest")
    g.add_argument("--uvicorn-log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug", "trace"])
