"""`octavo router`'s flags and its settings (RouterConfig), checked before anything loads.

Kept free of heavy imports: the CLI builds every subcommand's parser at start-up.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from urllib.parse import urlsplit

from octavo.engine_args import SUPPORTED_BLOCK_SIZES
from octavo.router.policy import (
    DEFAULT_BALANCE_ABS_THRESHOLD,
    DEFAULT_BALANCE_REL_THRESHOLD,
    POLICIES,
)

DEFAULT_HEALTH_INTERVAL = 2.0
DEFAULT_INDEX_BLOCKS = 16384  # per replica, until its /metrics tells its KV blocks
DEFAULT_MAX_REQUEST_BODY_BYTES = 8 << 20  # `octavo serve`'s default
DEFAULT_CONNECT_TIMEOUT = 5.0


@dataclass
class RouterConfig:
    replicas: list[str]
    model: str | None = None  # the replicas' model (its tokenizer renders prompts)
    block_size: int = 16
    policy: str = "prefix"
    balance_abs_threshold: int = DEFAULT_BALANCE_ABS_THRESHOLD
    balance_rel_threshold: float = DEFAULT_BALANCE_REL_THRESHOLD
    index_blocks: int | None = None  # None: each replica's KV blocks, from its /metrics
    health_interval: float = DEFAULT_HEALTH_INTERVAL
    connect_timeout: float = DEFAULT_CONNECT_TIMEOUT
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    shutdown_timeout: float = 30.0

    def __post_init__(self) -> None:
        if not self.replicas:
            raise ValueError("the router needs at least one replica (--replica URL)")
        self.replicas = [replica_url(u) for u in self.replicas]
        dup = {u for u in self.replicas if self.replicas.count(u) > 1}
        if dup:
            raise ValueError(f"--replica {sorted(dup)[0]} is given more than once")
        if self.block_size not in SUPPORTED_BLOCK_SIZES:
            raise ValueError(f"--block-size: {self.block_size} is not one of "
                             f"{', '.join(map(str, SUPPORTED_BLOCK_SIZES))}")
        if self.policy not in POLICIES:
            raise ValueError(f"--policy: {self.policy!r} is not one of {', '.join(POLICIES)}")
        if self.balance_abs_threshold < 0:
            raise ValueError("--balance-abs-threshold must be >= 0")
        if not self.balance_rel_threshold >= 1.0:
            raise ValueError("--balance-rel-threshold must be >= 1")
        if self.index_blocks is not None and self.index_blocks < 1:
            raise ValueError("--index-blocks must be >= 1")
        for name in ("health_interval", "connect_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0")
        if self.max_request_body_bytes < 1:
            raise ValueError("--max-request-body-bytes must be >= 1")


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
    g = p.add_argument_group("router")
    g.add_argument("--replica", action="append", default=[], metavar="URL",
                   help="an `octavo serve` replica, e.g. http://127.0.0.1:8001 (repeat it)")
    g.add_argument("--model", default=None,
                   help="the replicas' model: its tokenizer and chat template give the prompts' "
                   "token ids (default: the embedded SmolLM2-135M-Instruct)")
    g.add_argument("--block-size", type=int, default=16, choices=SUPPORTED_BLOCK_SIZES,
                   help="the replicas' --block-size (default: %(default)s)")
    g.add_argument("--policy", default="prefix", choices=POLICIES,
                   help="how a request picks its replica (default: %(default)s)")
    g.add_argument("--balance-abs-threshold", type=int, default=DEFAULT_BALANCE_ABS_THRESHOLD,
                   help="prefix policy: the longest-match replica is passed over for the least "
                   "loaded one when it has more than this many requests in flight more "
                   "(default: %(default)s) ...")
    g.add_argument("--balance-rel-threshold", type=float,
                   default=DEFAULT_BALANCE_REL_THRESHOLD,
                   help="... and more than this many times as many (default: %(default)s)")
    g.add_argument("--index-blocks", type=int, default=None,
                   help="blocks the router remembers per replica (default: the replica's KV "
                   f"blocks, from its /metrics; {DEFAULT_INDEX_BLOCKS} until known)")
    g.add_argument("--health-interval", type=float, default=DEFAULT_HEALTH_INTERVAL,
                   help="seconds between health checks of each replica (default: %(default)s)")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--max-request-body-bytes", type=int,
                   default=DEFAULT_MAX_REQUEST_BODY_BYTES, help="answer 413 above this size")
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="as the replicas have it (chat prompts with tools render as theirs)")
    g.add_argument("--tool-call-parser", default=None,
                   choices=["hermes", "llama3_json", "mistral", "pythonic"],
                   help="as the replicas have it")
    g.add_argument("--uvicorn-log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug", "trace"])


def router_config(ns: argparse.Namespace) -> RouterConfig:
    """The router's settings from `octavo router`'s flags."""
    return RouterConfig(
        replicas=list(ns.replica), model=ns.model, block_size=ns.block_size,
        policy=ns.policy, balance_abs_threshold=ns.balance_abs_threshold,
        balance_rel_threshold=ns.balance_rel_threshold, index_blocks=ns.index_blocks,
        health_interval=ns.health_interval, max_request_body_bytes=ns.max_request_body_bytes,
        enable_auto_tool_choice=ns.enable_auto_tool_choice,
        tool_call_parser=ns.tool_call_parser,
    )
