"""`octavo serve`'s settings (ServerConfig) and the flags generated from them; the engine's are
EngineArgs'. Each setting is declared once, with its default, help and check (options.py).

Kept free of heavy imports: the CLI builds every subcommand's parser at start-up.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import octavo.envs as envs
from octavo.options import (
    OptionError,
    add_flags,
    at_least,
    check_options,
    option,
    options_from_flags,
    positive,
)

DEFAULT_MAX_REQUEST_BODY_BYTES = 8 << 20
DEFAULT_MAX_WAITING_REQUESTS = 1024
DEFAULT_MAX_PROMPTS_PER_REQUEST = 128
DEFAULT_MAX_SEQUENCES_PER_REQUEST = 1024
DEFAULT_HEADER_TIMEOUT = 10.0
DEFAULT_TIMEOUT_KEEP_ALIVE = 5.0
DEFAULT_LIMIT_CONCURRENCY = 4096
DEFAULT_SHUTDOWN_TIMEOUT = 30.0
DEFAULT_MAX_STORED_RESPONSES = 1000
MAX_LOGPROBS = 20  # OpenAI's limit for top_logprobs
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral", "pythonic", "qwen3_coder")
REASONING_PARSERS = ("deepseek_r1", "qwen3")
LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")

SERVER, TOOLS, CONNECTIONS = ("server (vLLM's flag names)", "tools and reasoning (vLLM's flag "
                              "names)", "connections (uvicorn's names where it has one)")


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """Settings of the HTTP layer (the engine's are in EngineArgs)."""

    host: str = option("127.0.0.1", "address to listen on", group=SERVER)
    port: int = option(8000, "port to listen on", check=at_least(0), group=SERVER)
    served_model_names: list[str] = option(
        help="model name(s) the API answers to (default: --model as given, or the model "
        "directory's name)", default_factory=list, flag_name="--served-model-name",
        group=SERVER)
    api_key: str | None = option(
        None, "require `Authorization: Bearer KEY` (default: env OCTAVO_API_KEY; /health and "
        "/metrics stay open)", group=SERVER)
    api_key_file: str | None = option(
        None, "read the API key from this file (first line), so it stays out of the process "
        "list", group=SERVER)
    protect_metrics: bool = option(False, "/metrics needs the API key too", group=SERVER)
    max_waiting_requests: int | None = option(
        DEFAULT_MAX_WAITING_REQUESTS, "answer 503 while this many requests wait to be "
        "scheduled", check=at_least(0), group=SERVER)
    max_request_body_bytes: int = option(
        DEFAULT_MAX_REQUEST_BODY_BYTES, "answer 413 above this size", check=at_least(1),
        group=SERVER)
    max_prompts_per_request: int = option(
        DEFAULT_MAX_PROMPTS_PER_REQUEST, "answer 400 to a completion request with more "
        "prompts", check=at_least(1), group=SERVER)
    max_sequences_per_request: int = option(
        DEFAULT_MAX_SEQUENCES_PER_REQUEST, "answer 400 when prompts x n exceeds this",
        check=at_least(1), group=SERVER)
    max_logprobs: int = option(MAX_LOGPROBS, "the most logprobs a request may ask for",
                               check=at_least(0), cli=False)
    data_parallel_size: int = option(
        1, "run this many replicas of the server (child processes, each on a free 127.0.0.1 "
        "port with its share of the cores) behind a prefix-aware router on --host/--port "
        "(octavo/router)", check=at_least(1), group=SERVER)
    uvicorn_log_level: str = option("info", "uvicorn's log level", choices=LOG_LEVELS,
                                    group=SERVER)
    # tools and reasoning (server/chat/tools.py, server/chat/output.py)
    enable_auto_tool_choice: bool = option(
        False, "let the model decide when to call tools (tool_choice 'auto', the default when "
        "a request has tools); needs --tool-call-parser", group=TOOLS)
    tool_call_parser: str | None = option(
        None, "how tool calls are read from the model's output (and taught to models whose "
        "chat template does not render tools)", choices=TOOL_CALL_PARSERS, group=TOOLS)
    reasoning_parser: str | None = option(
        None, "split <think>...</think> reasoning into reasoning_content",
        choices=REASONING_PARSERS, group=TOOLS)
    reasoning_budget: int = option(
        -1, "reasoning tokens a request may think for before its end-of-thinking marker is "
        "forced (llama-server's flag; a request's thinking_token_budget overrides it); -1: no "
        "limit, 0: close the reasoning at once", check=at_least(-1), group=TOOLS)
    max_stored_responses: int = option(
        DEFAULT_MAX_STORED_RESPONSES, "responses kept in memory for previous_response_id "
        "(/v1/responses with store=true); the oldest go first", check=at_least(1), group=TOOLS)
    # connections and shutdown (server/connections.py, launcher.py)
    header_timeout: float = option(
        DEFAULT_HEADER_TIMEOUT, "close a connection that has not sent a whole request head "
        "this many seconds after it opened (or after its last response)", check=positive,
        group=CONNECTIONS)
    timeout_keep_alive: float = option(
        DEFAULT_TIMEOUT_KEEP_ALIVE, "close an idle keep-alive connection after this many "
        "seconds", check=positive, group=CONNECTIONS)
    limit_concurrency: int = option(
        DEFAULT_LIMIT_CONCURRENCY, "open connections at most; past it the oldest connection "
        "still waiting for its request head is closed, and requests get 503",
        check=at_least(1), group=CONNECTIONS)
    shutdown_timeout: float = option(
        DEFAULT_SHUTDOWN_TIMEOUT, "on SIGTERM / SIGINT: refuse new requests (503) and let "
        "those in flight finish for up to this many seconds, then abort the rest",
        check=positive, group=CONNECTIONS)

    def __post_init__(self) -> None:
        check_options(self, _error)
        if self.protect_metrics and not self.api_key:
            raise ValueError("--protect-metrics needs an API key (--api-key or --api-key-file)")
        if self.enable_auto_tool_choice and not self.tool_call_parser:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")

    def replace(self, **changes: Any) -> ServerConfig:
        return dataclasses.replace(self, **changes)


def _error(name: str, problem: str) -> OptionError:
    return OptionError(name, problem)


SERVER_OPTION_NAMES = frozenset(f.name for f in fields(ServerConfig))


def add_server_args(p: argparse.ArgumentParser) -> None:
    add_flags(p, ServerConfig)


def read_api_key(api_key: str | None, api_key_file: str | None) -> str | None:
    """The key from --api-key-file (its first line), else --api-key, else $OCTAVO_API_KEY."""
    if api_key_file:
        try:
            lines = Path(api_key_file).read_text().splitlines()
        except OSError as e:
            raise ValueError(f"--api-key-file: cannot read {api_key_file}: {e}") from e
        key = lines[0].strip() if lines else ""
        if not key:
            raise ValueError(f"--api-key-file: {api_key_file} holds no key")
        return key
    return api_key or envs.api_key()


def server_config(ns: argparse.Namespace) -> ServerConfig:
    """The server's settings from its flags; call before loading the model (fail fast). The
    API key is read here (file or environment); the served names default to --model."""
    key = read_api_key(getattr(ns, "api_key", None), getattr(ns, "api_key_file", None))
    model = getattr(ns, "model", None)
    names = list(getattr(ns, "served_model_names", None) or ([model] if model else []))
    return options_from_flags(ServerConfig, ns, api_key=key, api_key_file=None,
                              served_model_names=names)
