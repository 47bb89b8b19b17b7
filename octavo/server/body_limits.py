"""Request bodies, read whole before the app sees them, within limits of size, time and depth.

- size: 413 over `max_bytes`, on Content-Length or on the bytes received;
- time: a body that has not fully arrived `body_timeout` seconds after its head gets 408 and
  the connection is closed (nginx's client_body_timeout). Without it, clients that send a head
  and then trickle (or never send) the body hold their request slots for ever;
- count: at most `max_pending` requests may be waiting for the rest of their body; past it the
  one that has waited longest gets 503 and its connection is closed. A body sent with its head
  is whole before the app runs and never waits, so slow bodies cannot crowd out requests that
  come whole, /health included;
- depth: JSON nested deeper than `max_depth` gets 400 and one log line, before any parser or
  validator recurses into it (nesting ~1,000 deep would end in a RecursionError deep inside
  the validators: a 500 and a long traceback per request).

The body is then replayed to the app; after it, `receive` goes straight to the server so the
app still sees the client disconnect.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict

import numpy as np
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from octavo.server.middleware import send_error

logger = logging.getLogger(__name__)

MAX_JSON_DEPTH = 64
# bodies above this are scanned for depth on a worker thread (numpy lets go of the GIL)
SCAN_OFF_LOOP_BYTES = 256 << 10


def json_depth(body: bytes) -> int:
    """The deepest nesting of arrays and objects in a JSON text (brackets inside strings do
    not count); an upper bound for text that is not JSON. Vectorised: ~10 ms per MB."""
    openers = body.count(b"{") + body.count(b"[")
    if openers <= 1:
        return openers
    a = np.frombuffer(body, dtype=np.uint8)
    quote = a == ord('"')
    backslash = a == ord("\\")
    if backslash.any():  # a quote after an odd run of backslashes is part of the string
        idx = np.arange(len(a), dtype=np.int32)
        last_other = np.maximum.accumulate(np.where(backslash, -1, idx))
        run = np.zeros(len(a), dtype=np.int32)
        run[1:] = idx[:-1] - last_other[:-1]
        quote &= (run & 1) == 0
    outside = (np.cumsum(quote, dtype=np.int32) & 1) == 0
    opens = ((a == ord("{")) | (a == ord("["))) & outside
    closes = ((a == ord("}")) | (a == ord("]"))) & outside
    depth = np.cumsum(opens.astype(np.int32) - closes.astype(np.int32))
    return int(depth.max(initial=0))


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, max_bytes: int, body_timeout: float, max_pending: int,
                 max_depth: int = MAX_JSON_DEPTH) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.body_timeout = body_timeout
        self.max_pending = max_pending
        self.max_depth = max_depth
        # requests reading their body, oldest first: each one's eviction notice
        self.pending: OrderedDict[int, asyncio.Future[None]] = OrderedDict()
        self.num_timeouts = 0
        self.num_evicted = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        body = await self.read(scope, receive, send)
        if body is None:
            return
        depth = (await asyncio.to_thread(json_depth, body) if len(body) > SCAN_OFF_LOOP_BYTES
                 else json_depth(body))
        if depth > self.max_depth:
            logger.warning("refused a body nested %d levels deep (limit %d) on %s", depth,
                           self.max_depth, scope["path"])
            await send_error(send, 400, f"the JSON body is nested {depth} levels deep; at most "
                             f"{self.max_depth} levels are accepted")
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def read(self, scope: Scope, receive: Receive, send: Send) -> bytes | None:
        """The whole body, or None when it was refused (the answer sent) or the client left."""
        too_big = f"request body is larger than the limit of {self.max_bytes} bytes"
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await send_error(send, 413, too_big, close=True)
            return None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.body_timeout
        evicted: asyncio.Future[None] = loop.create_future()
        pending = False
        chunks: list[bytes] = []
        size = 0
        try:
            while True:
                get = asyncio.ensure_future(receive())
                if not pending:
                    await asyncio.sleep(0)  # what came with the head is there at once
                    if not get.done():  # the rest is still on its way: it waits, counted
                        pending = True
                        self._add_pending(evicted)
                message = await self._next(get, evicted, deadline - loop.time())
                if message is None:
                    if evicted.done():
                        self.num_evicted += 1
                        await send_error(send, 503, f"more than {self.max_pending} requests "
                                         "are still sending their bodies; retry later",
                                         close=True)
                    else:
                        self.num_timeouts += 1
                        await send_error(send, 408, "the request body did not arrive within "
                                         f"{self.body_timeout:g} s", close=True)
                    return None
                if message["type"] == "http.disconnect":
                    return None
                chunk = message.get("body", b"")
                size += len(chunk)
                if size > self.max_bytes:
                    await send_error(send, 413, too_big, close=True)
                    return None
                chunks.append(chunk)
                if not message.get("more_body", False):
                    return b"".join(chunks)
        finally:
            self.pending.pop(id(evicted), None)

    def _add_pending(self, evicted: asyncio.Future[None]) -> None:
        """Count a request as waiting for its body; past the cap the longest waiting one is
        told to give up."""
        self.pending[id(evicted)] = evicted
        if len(self.pending) > self.max_pending:
            _, oldest = self.pending.popitem(last=False)
            if not oldest.done():
                oldest.set_result(None)

    @staticmethod
    async def _next(get: asyncio.Future[Message], evicted: asyncio.Future[None],
                    timeout: float) -> Message | None:
        """`get`'s message, or None when the time is up or the request was evicted first."""
        if not get.done():
            if timeout > 0 and not evicted.done():
                await asyncio.wait({get, evicted}, timeout=timeout,
                                   return_when=asyncio.FIRST_COMPLETED)
            if not get.done():
                get.cancel()
                return None
        return get.result()
