"""Connection hardening: what uvicorn alone does not do against idle and half-open clients.

- A header timeout: a connection that has not sent a whole request head within
  `header_timeout` seconds of opening (or of its last response) is closed. uvicorn only times
  out idle keep-alive connections, so 20,000 clients that never finish their headers would
  hold 20,000 file descriptors forever.
- A cap on open connections (`limit_concurrency`): past it, the connection that has waited
  longest for its request head is closed to make room, once it has waited a moment (a client
  that sends its request at once, a probe of /health say, always gets in). Only when the
  process is about to run out of descriptors is a new connection itself turned away. Requests
  in flight are capped at the same number: past it, 503 (middleware.InFlightLimitMiddleware).
- TCP_NODELAY on every connection, whatever socket it was accepted on (no_delay).
- The soft file-descriptor limit is raised to the hard one, so the cap, not the OS, decides.
- Repeated log lines (accept() failing for lack of descriptors, invalid requests, a refused
  body, a replica's error) are written once per interval with a count, not once per
  connection: on uvicorn's and asyncio's loggers and on every one of octavo's.

The body half (read timeout, pending bodies, size, depth) is ASGI middleware: body_limits.py.
"""

from __future__ import annotations

import contextlib
import logging
import resource
import socket
import time
from collections import OrderedDict
from typing import Any

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from octavo.server.args import FrontDoorConfig

LOG_INTERVAL_S = 10.0
# a connection this young is never closed to make room: its request may be on its way
MIN_IDLE_AGE_S = 0.25


class ConnectionGuard:
    """Shared by every connection of one server."""

    def __init__(self, header_timeout: float, max_connections: int,
                 hard_max_connections: int) -> None:
        self.header_timeout = header_timeout
        self.max_connections = max_connections
        self.hard_max_connections = max(hard_max_connections, max_connections)
        # connections waiting for a request head, oldest first
        self.waiting: OrderedDict[int, GuardedH11Protocol] = OrderedDict()
        self.num_header_timeouts = 0
        self.num_evicted = 0


def no_delay(transport: Any) -> None:
    """TCP_NODELAY on the connection. asyncio sets it only on sockets whose `proto` is
    IPPROTO_TCP; a listening socket made as socket(AF_INET, SOCK_STREAM) (proto 0) hands out
    connections without it, and then the body of every response after the first on a
    keep-alive connection waits on Nagle's algorithm for the client's delayed ACK: 40 ms per
    request and per streamed chunk on Linux."""
    sock = transport.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class GuardedH11Protocol(H11Protocol):
    guard: ConnectionGuard  # set on the subclass made for each server (protocol_class)

    def connection_made(self, transport: Any) -> None:  # type: ignore[override]
        super().connection_made(transport)
        no_delay(transport)
        self._header_timer: Any = None
        self._wait_for_request_head()
        guard = self.guard
        # one out for each one in over the cap (a closed transport leaves `connections` only
        # when its connection_lost runs, a loop iteration later)
        if len(self.connections) > guard.max_connections and len(guard.waiting) > 1:
            oldest = next(iter(guard.waiting.values()))
            if self.loop.time() - oldest._waiting_since >= MIN_IDLE_AGE_S:
                guard.num_evicted += 1
                oldest._close_idle()
            elif len(self.connections) > guard.hard_max_connections:
                guard.num_evicted += 1
                self._close_idle()

    def _wait_for_request_head(self) -> None:
        """From now until a request head arrives, the header timeout runs."""
        self._cycle_before_head = self.cycle
        self._waiting_since = self.loop.time()
        self.guard.waiting.pop(id(self), None)  # to the young end
        self.guard.waiting[id(self)] = self
        if self._header_timer is not None:
            self._header_timer.cancel()
        self._header_timer = self.loop.call_later(self.guard.header_timeout, self._header_late)

    def _head_arrived(self) -> bool:
        return self.cycle is not self._cycle_before_head

    def _stop_waiting(self) -> None:
        self.guard.waiting.pop(id(self), None)
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _between_requests(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def _header_late(self) -> None:
        self._header_timer = None
        if self._between_requests() and not self._head_arrived():
            self.guard.num_header_timeouts += 1
            self._close_idle()

    def _close_idle(self) -> None:
        self._stop_waiting()
        if not self.transport.is_closing():
            self.transport.close()

    def handle_events(self) -> None:
        super().handle_events()
        if self._head_arrived():
            self._stop_waiting()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # may start a pipelined request
        if not self.transport.is_closing() and self._between_requests():
            self._wait_for_request_head()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_waiting()
        super().connection_lost(exc)


def protocol_class(guard: ConnectionGuard) -> type[GuardedH11Protocol]:
    return type("OctavoH11Protocol", (GuardedH11Protocol,), {"guard": guard})


class RateLimitedLog(logging.Filter):
    """Lets the first record of each message through, then at most one per interval, saying
    how many of the same were dropped in between."""

    def __init__(self, interval_s: float = LOG_INTERVAL_S) -> None:
        super().__init__()
        self.interval_s = interval_s
        self._last: dict[str, float] = {}
        self._dropped: dict[str, int] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        key = f"{record.name}:{str(record.msg).splitlines()[0][:120] if record.msg else ''}"
        now = time.monotonic()
        last = self._last.get(key)
        if last is not None and now - last < self.interval_s:
            self._dropped[key] = self._dropped.get(key, 0) + 1
            return False
        self._last[key] = now
        dropped = self._dropped.pop(key, 0)
        if dropped:
            record.msg = f"{record.msg} (and {dropped} more like it in the last " \
                         f"{self.interval_s:.0f} s)"
        if record.exc_info and last is not None:
            record.exc_info = None  # one traceback per message is enough
        return True

    def reset(self) -> None:
        """Forget what was logged: the next record of each message passes."""
        self._last.clear()
        self._dropped.clear()


_FILTER = RateLimitedLog()
_NOISY_LOGGERS = ("asyncio", "uvicorn.error")


def rate_limit_noisy_logs() -> None:
    """The filter on uvicorn's and asyncio's loggers and on every octavo logger made so far (a
    logger's filters see only what is logged on it, not what its children pass up)."""
    names = {*_NOISY_LOGGERS, "octavo",
             *(n for n in list(logging.root.manager.loggerDict) if n.startswith("octavo."))}
    for name in names:
        log = logging.getLogger(name)
        if _FILTER not in log.filters:
            log.addFilter(_FILTER)


def reset_log_rate_limits() -> None:
    """The rate limit of rate_limit_noisy_logs() starts afresh (servers of one process that
    should each log their first lines, as tests start them)."""
    _FILTER.reset()


def raise_fd_limit(want: int = 1 << 16) -> int:
    """RLIMIT_NOFILE up to `want` where the process may raise its hard limit (root), else the
    soft limit up to the hard one; returns the soft limit in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    for target in (max(want, soft), hard):
        if target == resource.RLIM_INFINITY or target <= soft:
            continue
        new_hard = hard if hard == resource.RLIM_INFINITY else max(hard, target)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, new_hard))
            break
        except (ValueError, OSError):
            continue
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def uvicorn_config(app: Any, config: FrontDoorConfig, **options: Any) -> uvicorn.Config:
    """uvicorn's Config with octavo's connection settings (`options`: host, port, log_level)."""
    fds = raise_fd_limit()
    # leave descriptors for the listening socket, model files, logs and the engine
    usable = max(1, fds - 256)
    guard = ConnectionGuard(config.header_timeout, min(config.limit_concurrency, usable), usable)
    rate_limit_noisy_logs()
    return uvicorn.Config(
        app, http=protocol_class(guard), timeout_keep_alive=config.timeout_keep_alive,
        timeout_graceful_shutdown=5, **options,
    )
