"""One request forwarded to a replica, as an ASGI response.

- The body goes upstream as it came; so do the headers, less the hop-by-hop ones (the client's
  `Authorization` / `x-api-key` reach the replica, which checks them).
- The replica's status, headers and body come back byte for byte as they arrive (SSE streams
  event by event, errors with their bodies). `x-octavo-replica` names the replica (its
  position in the router's list).
- A replica that refuses the connection has not seen the request: it is marked down and the
  request goes to the next choice. Any other failure before the response starts is a 502.
- A replica that dies mid-response, or hangs (replicas.py: it answers nothing for
  --replica-timeout seconds), ends the response with an error: a 502/504 if it had not
  started, else the API's error event in a stream (OpenAI's `data: {"error": ...}` then
  `[DONE]`, Anthropic's and the Responses API's `event: error`), never a silent cut.
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
# a stream's bytes held back waiting for the end of their event, at most
MAX_PENDING_EVENT_BYTES = 1 << 20

# exclude -> (replica, reason, matched blocks) or None when no replica is left
Route = Callable[[set[int]], tuple[Replica, str, int] | None]


def request_headers(headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    return [(k, v) for k, v in headers if k.decode("latin-1").lower() not in HOP_BY_HOP]


def error_json(path: str, status: int, message: str,
               param: str | None = None) -> dict[str, Any]:
    """The replicas' error shape: Anthropic's under /v1/messages, OpenAI's elsewhere."""
    if path.startswith("/v1/messages"):
        return anthropic_error_payload(status, message)
    return error_body(status, message, param).model_dump()


async def send_error(send: Send, path: str, status: int, message: str) -> None:
    body = json.dumps(error_json(path, status, message)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


async def wait_for_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


def sse_error_event(path: str, message: str) -> bytes:
    """The last event of a stream the router had to end: each API's own error event."""
    if path.startswith("/v1/messages"):
        payload = anthropic_error_payload(502, message)
        return f"event: error\ndata: {json.dumps(payload)}\n\n".encode()
    if path.startswith("/v1/responses"):
        payload = {"type": "error", "code": "server_error", "message": message, "param": None}
        return f"event: error\ndata: {json.dumps(payload)}\n\n".encode()
    payload = error_body(502, message).model_dump()
    return f"data: {json.dumps(payload)}\n\ndata: [DONE]\n\n".encode()


class ProxyResponse(Response):
    """One request forwarded to the replica its route picks (the next one when a replica
    refuses the connection). The client leaving cancels it upstream; a replica that dies or
    hangs mid-response ends it with an error: a 502/504 before the response started, the
    API's error event in a stream (whose events are forwarded whole, so that event never lands
    inside a cut one)."""

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
        self.started = False  # the response's head was sent
        self.events = False  # ... and it is a Server-Sent Events stream
        self.cut_reason = ""
        self._cut = asyncio.Event()

    def cut(self, reason: str) -> None:
        """End the request with an error (its replica hung)."""
        self.cut_reason = reason
        self._cut.set()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        forward = asyncio.ensure_future(self.forward(send))
        watch = asyncio.ensure_future(wait_for_disconnect(receive))
        cut = asyncio.ensure_future(self._cut.wait())
        try:
            done, _ = await asyncio.wait({forward, watch, cut},
                                         return_when=asyncio.FIRST_COMPLETED)
            if forward in done:
                forward.result()
            else:  # the client left, or the replica hung: cancel the upstream request
                forward.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await forward
                if watch not in done:
                    await self.end_with_error(send, 504, self.cut_reason)
        finally:
            watch.cancel()
            cut.cancel()
            if not forward.done():  # we were cancelled ourselves (server shutdown)
                forward.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await forward

    async def end_with_error(self, send: Send, status: int, message: str) -> None:
        if not self.started:
            await send_error(send, self.path, status, message)
            return
        tail = sse_error_event(self.path, message) if self.events else b""
        await send({"type": "http.response.body", "body": tail, "more_body": False})

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
            replica.cuts.add(self.cut)
            try:
                if await self.forward_to(replica, send):
                    return
            finally:
                replica.cuts.discard(self.cut)
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
            self.events = (upstream.headers.get("content-type", "").startswith(
                "text/event-stream") and "content-encoding" not in upstream.headers)
            await send({"type": "http.response.start", "status": upstream.status_code,
                        "headers": headers})
            self.started = True
            pending = b""  # a stream's event not whole yet
            try:
                async for chunk in upstream.aiter_raw():
                    if self.events:
                        pending += chunk
                        end = pending.rfind(b"\n\n") + 2
                        if end < 2 and len(pending) < MAX_PENDING_EVENT_BYTES:
                            continue
                        end = end if end >= 2 else len(pending)
                        chunk, pending = pending[:end], pending[end:]
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
            except httpx.HTTPError as e:  # the replica died mid-response: say so, end it
                self.dispatcher.failed(replica, str(e), down=False)
                logger.warning("router: replica %s broke off a response: %r", replica.url, e)
                await self.end_with_error(send, 502, f"replica {replica.rid} broke off the "
                                          "response")
                return True
            await send({"type": "http.response.body", "body": pending, "more_body": False})
        finally:
            await upstream.aclose()
        return True
