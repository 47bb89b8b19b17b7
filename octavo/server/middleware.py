"""Pure-ASGI middlewares: API-key check and request-body size limit.

Pure ASGI rather than Starlette's BaseHTTPMiddleware, which wraps `receive` in a way that hides
the client's disconnect from streaming responses: cancellation relies on seeing it.
"""

from __future__ import annotations

import hmac
import json
from http.cookies import CookieError, SimpleCookie
from urllib.parse import parse_qsl, urlencode

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from octavo.server.errors import error_body

# Liveness probes and Prometheus scrapers carry no key, as in vLLM (unless --protect-metrics).
OPEN_PATHS = frozenset({"/health", "/metrics"})
# What a browser opens: it cannot add a header, so the key may come as a cookie here
# (GET only), set by one visit to /dashboard?api_key=KEY (Jupyter's token login).
DASHBOARD = "/dashboard"
KV_MAP = "/v1/kv_map"
KEY_COOKIE = "octavo_api_key"
KEY_PARAM = "api_key"
REDACTED = "redacted"


def reads_cookie(path: str) -> bool:
    """The dashboard and the KV map endpoints it reads."""
    return path in (DASHBOARD, KV_MAP) or path.startswith(KV_MAP + "/")


async def send_error(send: Send, status: int, message: str) -> None:
    body = json.dumps(error_body(status, message).model_dump()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def bearer_token(header: bytes) -> bytes:
    """The credentials of `Authorization: Bearer <token>`; the scheme is case-insensitive
    (RFC 9110), surrounding blanks are ignored. Empty when the scheme is another one."""
    scheme, _, token = header.strip().partition(b" ")
    return token.strip() if scheme.lower() == b"bearer" else b""


class APIKeyMiddleware:
    """401 unless `Authorization: Bearer <key>` or `x-api-key: <key>` (how Anthropic's clients
    send it) matches; constant-time comparison."""

    def __init__(self, app: ASGIApp, api_key: str, protect_metrics: bool = False) -> None:
        self.app = app
        self.expected = api_key.encode()
        self.open_paths = OPEN_PATHS - ({"/metrics"} if protect_metrics else set())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        login = pop_query_key(scope) if scope["type"] == "http" else None
        if (scope["type"] != "http" or scope["path"] in self.open_paths
                or scope["method"] == "OPTIONS"):
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        given = [bearer_token(headers.get(b"authorization", b"")),
                 headers.get(b"x-api-key", b"").strip()]
        browser = reads_cookie(scope["path"]) and scope["method"] in ("GET", "HEAD")
        if browser:
            given.append(cookie_value(headers.get(b"cookie", b""), KEY_COOKIE))
            if scope["path"] == DASHBOARD and login and self.matches(login.encode()):
                await send_login(send, login)
                return
        if not any(self.matches(key) for key in given):
            hint = (" or open /dashboard?api_key=KEY once in the browser"
                    if browser else "")
            await send_error(send, 401, "missing or invalid API key (Authorization: Bearer ... "
                             f"or x-api-key{hint})")
            return
        await self.app(scope, receive, send)

    def matches(self, key: bytes) -> bool:
        return bool(key) and hmac.compare_digest(key, self.expected)


def pop_query_key(scope: Scope) -> str | None:
    """The `api_key` query parameter's value, if any, blanked out in the scope itself: the
    access log line (uvicorn writes it from this scope when the response starts) and the app
    never see the key, right or wrong."""
    query = scope.get("query_string", b"")
    if KEY_PARAM.encode() not in query:
        return None
    pairs = parse_qsl(query.decode("latin-1"), keep_blank_values=True)
    values = [v for k, v in pairs if k == KEY_PARAM]
    if not values:
        return None
    scope["query_string"] = urlencode(
        [(k, REDACTED if k == KEY_PARAM else v) for k, v in pairs]).encode("latin-1")
    return values[0]


def cookie_value(header: bytes, name: str) -> bytes:
    try:
        morsel = SimpleCookie(header.decode("latin-1")).get(name)
    except CookieError:
        return b""
    return morsel.value.encode("latin-1") if morsel is not None else b""


async def send_login(send: Send, key: str) -> None:
    """303 to the bare page, the key kept as a cookie the page's own requests carry (HttpOnly:
    no script reads it; SameSite=Strict: no other site's page sends it)."""
    cookie = SimpleCookie()
    cookie[KEY_COOKIE] = key
    morsel = cookie[KEY_COOKIE]
    morsel["httponly"] = True
    morsel["samesite"] = "Strict"
    morsel["path"] = "/"
    headers = [(b"location", DASHBOARD.encode()), (b"content-length", b"0"),
               (b"set-cookie", morsel.OutputString().encode("latin-1"))]
    await send({"type": "http.response.start", "status": 303, "headers": headers})
    await send({"type": "http.response.body", "body": b""})


class BodySizeLimitMiddleware:
    """413 for a body over `max_bytes`, checked on Content-Length and on the bytes received.

    The body is read up front (at most max_bytes + one chunk) and replayed to the app; after
    it, `receive` goes straight to the server so the app still sees the client disconnect.
    """

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        too_big = f"request body is larger than the limit of {self.max_bytes} bytes"
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await send_error(send, 413, too_big)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await send_error(send, 413, too_big)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


class InFlightLimitMiddleware:
    """503 while `max_in_flight` requests are being answered (streams included); idle
    connections do not count (server/connections.py closes them past its cap)."""

    def __init__(self, app: ASGIApp, max_in_flight: int) -> None:
        self.app = app
        self.max_in_flight = max_in_flight
        self.in_flight = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.in_flight >= self.max_in_flight:
            await send_error(send, 503, f"the server is answering {self.in_flight} requests, "
                             "its limit (--limit-concurrency); retry later")
            return
        self.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1
