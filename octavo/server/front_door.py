"""The front door of an app: what every request passes before a route sees it, the same for
`octavo serve` and `octavo router` (FrontDoorConfig holds the settings).

In the order a request meets them: the Host check (on by default on a loopback address), the
in-flight limit, the API key, the body limits (size, read time, pending bodies, JSON depth).
The connection-level half (header timeout, connection cap) is uvicorn's protocol,
connections.py.
"""

from __future__ import annotations

from fastapi import FastAPI

from octavo.server.args import FrontDoorConfig
from octavo.server.body_limits import BodyLimitMiddleware
from octavo.server.middleware import (
    OPEN_PATHS,
    AllowedHostsMiddleware,
    APIKeyMiddleware,
    InFlightLimitMiddleware,
)


def install_front_door(app: FastAPI, config: FrontDoorConfig, bound_host: str) -> set[str]:
    """Add the middlewares; returns the paths open without a key."""
    # the last middleware added runs first
    app.add_middleware(BodyLimitMiddleware, max_bytes=config.max_request_body_bytes,
                       body_timeout=config.body_timeout, max_pending=config.max_pending_bodies)
    open_paths = set(OPEN_PATHS)
    if config.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=config.api_key,
                           protect_metrics=config.protect_metrics)
        if config.protect_metrics:
            open_paths.discard("/metrics")
    app.add_middleware(InFlightLimitMiddleware, max_in_flight=config.limit_concurrency)
    allowed = config.hosts_allowed(bound_host)
    if allowed is not None:
        app.add_middleware(AllowedHostsMiddleware, allowed=allowed)
    return open_paths
