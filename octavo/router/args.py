"""`octavo router`'s flags and its settings (RouterConfig), checked before anything loads.

Kept free of heavy imports: the CLI builds every subcommand's parser at start-up.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from urllib.parse import urlsplit

from octavo.engine_args import SUPPORTED_BLOCK_SIZES
from octavo.options import (
    OptionError,
    add_flags,
    at_least,
    check_options,
    flag,
    option,
    options_from_flags,
    positive,
)
from octavo.router.policy import (
    DEFAULT_BALANCE_ABS_THRESHOLD,
    DEFAULT_BALANCE_REL_THRESHOLD,
    POLICIES,
)

DEFAULT_HEALTH_INTERVAL = 2.0
DEFAULT_INDEX_BLOCKS = 16384  # per replica, until its /metrics tells its KV blocks
DEFAULT_MAX_REQUEST_BODY_BYTES = 8 << 20  # `octavo serve`'s default
DEFAULT_CONNECT_TIMEOUT = 5.0
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral", "pythonic")  # `octavo serve`'s
LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


ROUTER = "router"


@dataclass(frozen=True, slots=True)
class RouterConfig:
    replicas: list[str] = option(
        help="an `octavo serve` replica, e.g. http://127.0.0.1:8001 (repeat it)",
        default_factory=list, action="append", flag_name="--replica", group=ROUTER)
    model: str | None = option(
        None, "the replicas' model: its tokenizer and chat template give the prompts' token ids "
        "(default: the embedded SmolLM2-135M-Instruct)", group=ROUTER)
    block_size: int = option(16, "the replicas' --block-size", choices=SUPPORTED_BLOCK_SIZES,
                             group=ROUTER)
    policy: str = option("prefix", "how a request picks its replica", choices=POLICIES,
                         group=ROUTER)
    balance_abs_threshold: int = option(
        DEFAULT_BALANCE_ABS_THRESHOLD, "prefix policy: the longest-match replica is passed over "
        "for the least loaded one when it has more than this many requests in flight more ...",
        check=at_least(0), group=ROUTER)
    balance_rel_threshold: float = option(
        DEFAULT_BALANCE_REL_THRESHOLD, "... and more than this many times as many",
        check=at_least(1.0), group=ROUTER)
    kv_tier_shared: bool = option(
        False, "the replicas share one KV tier (--kv-offload-dir on one directory, or one "
        "--kv-offload-url): a prefix sent to any of them is a cheap tier hit on every other, "
        "which the prefix policy weighs", group=ROUTER)
    index_blocks: int | None = option(
        None, "blocks the router remembers per replica (default: the replica's KV blocks, from "
        f"its /metrics; {DEFAULT_INDEX_BLOCKS} until known)", check=at_least(1), group=ROUTER)
    health_interval: float = option(DEFAULT_HEALTH_INTERVAL, "seconds between health checks of "
                                    "each replica", check=positive, group=ROUTER)
    connect_timeout: float = option(DEFAULT_CONNECT_TIMEOUT, "seconds to connect to a replica",
                                    check=positive, group=ROUTER)
    host: str = option("127.0.0.1", "address to listen on", group=ROUTER)
    port: int = option(8000, "port to listen on", check=at_least(0), group=ROUTER)
    max_request_body_bytes: int = option(DEFAULT_MAX_REQUEST_BODY_BYTES,
                                         "answer 413 above this size", check=at_least(1),
                                         group=ROUTER)
    enable_auto_tool_choice: bool = option(
        False, "as the replicas have it (chat prompts with tools render as theirs)",
        group=ROUTER)
    tool_call_parser: str | None = option(None, "as the replicas have it",
                                          choices=TOOL_CALL_PARSERS, group=ROUTER)
    shutdown_timeout: float = option(30.0, "on SIGTERM / SIGINT: let the requests in flight "
                                     "finish for up to this many seconds", check=positive,
                                     group=ROUTER)
    uvicorn_log_level: str = option("info", "uvicorn's log level", choices=LOG_LEVELS,
                                    group=ROUTER)

    def __post_init__(self) -> None:
        if not self.replicas:
            raise ValueError("the router needs at least one replica (--replica URL)")
        object.__setattr__(self, "replicas", [replica_url(u) for u in self.replicas])
        dup = {u for u in self.replicas if self.replicas.count(u) > 1}
        if dup:
            raise ValueError(f"--replica {sorted(dup)[0]} is given more than once")
        check_options(self, _flag_error)


def _flag_error(name: str, problem: str) -> OptionError:
    return OptionError(flag(name), problem)


def replica_url(url: str) -> str:
    """`http(s)://host:port` (an optional path prefix kept, no trailing slash), or ValueError."""
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"--replica {url!r} is not an http(s)://host:port URL")
    try:
        parts.port  # noqa: B018 - raises on a bad port
    except ValueError as e:
        raise ValueError(f"--replica {url!r}: {e}") from None
    if parts.query or parts.fragment:
        raise ValueError(f"--replica {url!r} may not have a query or a fragment")
    return f"{parts.scheme}://{parts.netloc}{parts.path.rstrip('/')}"


def add_router_args(p: argparse.ArgumentParser) -> None:
    add_flags(p, RouterConfig)


def router_config(ns: argparse.Namespace) -> RouterConfig:
    """The router's settings from `octavo router`'s flags."""
    return options_from_flags(RouterConfig, ns)
