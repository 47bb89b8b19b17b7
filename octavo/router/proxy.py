"""One request forwarded to a replica, as an ASGI response.

- The body goes upstream as it came; so do the headers, less the hop-by-hop ones (the client's
  `Authorization` / `x-api-key` reach the replica, which checks them).
- The replica's status, headers and body come back byte for byte as they arrive (SSE streams
  chunk by chunk, errors with their bodies). `x-octavo-replica` names the replica (its
  position in the router's list).
- A replica that refuses the connection has not seen the request: it is marked down and the
  request goes to the next choice. Any other failure before the response starts is a 502.
- The client's disconnect is watched from the start (a non-streamed completion sends nothing
  until it is done): the upstream request is cancelled at once, its connection closed, and
  the replica aborts the request and frees its KV blocks, as it would for a direct client.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Callable
from typing import Any

import httpx
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from octavo.router.dispatch import Dispatcher
from octavo.router.prompts import PromptKeys
from octavo.router.replicas import Replica
from octavo.server.anthropic.serving import error_payload as anthropic_error_payload
from octavo.server.errors import error_body

logger = logging.getLogger(__name__)

HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization",
                        "te", "trailer", "trailers", "transfer-encoding", "upgrade", "host",
                        "content-length"})
# the router's own server adds these
RESPONSE_SKIP = HOP_BY_HOP - {"content-length"} | {"server", "date"}
REPLICA_HEADER = "x-octavo-replica"

# exclude -> (replica, reason, matched blocks) or None when no replica is left
Route = Callable[[set[int]], tuple[Replica, str, int] | None]


def request_headers(headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    return [(k, v) for k, v in headers if k.decode("latin-1").lower() not in HOP_BY_HOP]


def error_json(path: str, status: int, message: str) -> dict[str, Any]:
    """The replicas' error shape: Anthropic's under /v1/messages, OpenAI's elsewhere."""
    if path.startswith("/v1/messages"):
        return anthropic_error_payload(status, message)
    return error_body(status, message).model_dump()


async def send_error(send: Send, path: str, status: int, message: str) -> None:
    body = json.dumps(error_json(path, status, message)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


async def wait_for_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class ProxyResponse(Response):
    def __init__(self, dispatcher: Dispatcher, client: httpx.AsyncClient, method: str,
                 path: str, query: bytes, headers: list[tuple[bytes, bytes]], body: bytes,
                 keys: PromptKeys, route: Route) -> None:
        self.dispatcher = dispatcher
        self.client = client
        self.method = method
        self.path = path
        self.query = query
        self.headers_out = request_headers(headers)
        self.body_out = body
        self.keys = keys
        self.route = route
        self.background = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        forward = asyncio.ensure_future(self.forward(send))
        watch = asyncio.ensure_future(wait_for_disconnect(receive))
        try:
            done, _ = await asyncio.wait({forward, watch}, return_when=asyncio.FIRST_COMPLETED)
            if forward not in done:  # the client left: cancel the upstream request
                forward.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await forward
            else:
                forward.result()
        finally:
            watch.cancel()
            if not forward.done():  # we were cancelled ourselves (server shutdown)
                forward.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await forward

    async def forward(self, send: Send) -> None:
        tried: set[int] = set()
        while True:
            chosen = self.route(tried)
            if chosen is None:
                msg = ("no healthy replica" if not tried else
                       f"no healthy replica (refused by {len(tried)})")
                await send_error(send, self.path, 503, msg)
                return
            replica, reason, matched = chosen
            self.dispatcher.begin(replica, self.keys, reason, matched)
            try:
                if await self.forward_to(replica, send):
                    return
            finally:
                self.dispatcher.end(replica)
            tried.add(replica.rid)

    async def forward_to(self, replica: Replica, send: Send) -> bool:
        """Forward to `replica`; False: it refused the connection (try another)."""
        url = f"{replica.url}{self.path}"
        request = self.client.build_request(
            self.method, url, params=self.query.decode("latin-1") or None,
            headers=self.headers_out, content=self.body_out)
        try:
            upstream = await self.client.send(request, stream=True)
        except (httpx.ConnectError, httpx.ConnectTimeout) as e:
            self.dispatcher.failed(replica, f"{type(e).__name__}: {e}", down=True)
            return False
        except httpx.HTTPError as e:
            self.dispatcher.failed(replica, str(e), down=False)
            await send_error(send, self.path, 502, f"replica {replica.rid} failed: "
                             f"{type(e).__name__}")
            return True
        try:
            headers = [(k, v) for k, v in upstream.headers.raw
                       if k.decode("latin-1").lower() not in RESPONSE_SKIP]
            headers.append((REPLICA_HEADER.encode(), str(replica.rid).encode()))
            await send({"type": "http.response.start", "status": upstream.status_code,
                        "headers": headers})
            try:
                async for chunk in upstream.aiter_raw():
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
            except httpx.HTTPError as e:  # the replica died mid-response: end it short
                self.dispatcher.failed(replica, str(e), down=False)
                logger.warning("router: replica %s broke off a response: %r", replica.url, e)
                raise
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            await upstream.aclose()
        return True
