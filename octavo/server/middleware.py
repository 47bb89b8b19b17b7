"""Pure-ASGI middlewares: the API-key check (and the dashboard's login session), the Host
check, the in-flight limit. The body limits are in body_limits.py.

Pure ASGI rather than Starlette's BaseHTTPMiddleware, which wraps `receive` in a way that hides
the client's disconnect from streaming responses: cancellation relies on seeing it.
"""

from __future__ import annotations

import hmac
import json
import secrets
import time
from collections import OrderedDict
from http.cookies import CookieError, SimpleCookie
from urllib.parse import parse_qsl, urlencode

from starlette.types import ASGIApp, Receive, Scope, Send

from octavo.server.errors import error_body

# Liveness probes and Prometheus scrapers carry no key, as in vLLM (unless --protect-metrics).
OPEN_PATHS = frozenset({"/health", "/metrics"})
# What a browser opens: it cannot add a header, so a login session may come as a cookie here
# (GET only), set by one visit to /dashboard?api_key=KEY (Jupyter's token login). The cookie
# holds a random session token mapped server-side, never the key itself.
DASHBOARD = "/dashboard"
KV_MAP = "/v1/kv_map"
SESSION_COOKIE = "octavo_session"
KEY_PARAM = "api_key"
REDACTED = "redacted"
SESSION_TTL_S = 12 * 3600
MAX_SESSIONS = 1024


def reads_cookie(path: str) -> bool:
    """The dashboard and the KV map endpoints it reads."""
    return path in (DASHBOARD, KV_MAP) or path.startswith(KV_MAP + "/")


async def send_error(send: Send, status: int, message: str, *, close: bool = False) -> None:
    """An error in OpenAI's shape; `close`: the connection closes after it (a body left
    unread)."""
    body = json.dumps(error_body(status, message).model_dump()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def bearer_token(header: bytes) -> bytes:
    """The credentials of `Authorization: Bearer <token>`; the scheme is case-insensitive
    (RFC 9110), surrounding blanks are ignored. Empty when the scheme is another one."""
    scheme, _, token = header.strip().partition(b" ")
    return token.strip() if scheme.lower() == b"bearer" else b""


class LoginSessions:
    """The dashboard's login sessions: random tokens, each valid for `ttl_s` seconds; at most
    `max_sessions`, the oldest forgotten first. A token says nothing about the key."""

    def __init__(self, ttl_s: float = SESSION_TTL_S, max_sessions: int = MAX_SESSIONS) -> None:
        self.ttl_s = ttl_s
        self.max_sessions = max_sessions
        self._expiry: OrderedDict[str, float] = OrderedDict()

    def new(self) -> str:
        token = secrets.token_urlsafe(32)
        self._expiry[token] = time.monotonic() + self.ttl_s
        while len(self._expiry) > self.max_sessions:
            self._expiry.popitem(last=False)
        return token

    def valid(self, token: bytes) -> bool:
        if not token:
            return False
        key = token.decode("latin-1")
        expiry = self._expiry.get(key)
        if expiry is None:
            return False
        if time.monotonic() > expiry:
            del self._expiry[key]
            return False
        return True


class APIKeyMiddleware:
    """401 unless `Authorization: Bearer <key>` or `x-api-key: <key>` (how Anthropic's clients
    send it) matches, constant-time; the dashboard's GETs may carry a login session instead."""

    def __init__(self, app: ASGIApp, api_key: str, protect_metrics: bool = False) -> None:
        self.app = app
        self.expected = api_key.encode()
        self.open_paths = OPEN_PATHS - ({"/metrics"} if protect_metrics else set())
        self.sessions = LoginSessions()

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
            if scope["path"] == DASHBOARD and login and self.matches(login.encode()):
                await send_login(send, self.sessions.new(), secure=is_https(scope),
                                 max_age=int(self.sessions.ttl_s))
                return
            if self.sessions.valid(cookie_value(headers.get(b"cookie", b""), SESSION_COOKIE)):
                await self.app(scope, receive, send)
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


def is_https(scope: Scope) -> bool:
    """The client reached us over TLS: uvicorn's own, or a proxy's that says so."""
    forwarded = dict(scope["headers"]).get(b"x-forwarded-proto", b"")
    return scope.get("scheme") == "https" or forwarded.strip().lower() == b"https"


async def send_login(send: Send, token: str, *, secure: bool, max_age: int) -> None:
    """303 to the bare page, the session token kept as a cookie the page's own requests carry
    (HttpOnly: no script reads it; SameSite=Strict: no other site's page sends it; Secure
    behind TLS: never sent in the clear)."""
    cookie = SimpleCookie()
    cookie[SESSION_COOKIE] = token
    morsel = cookie[SESSION_COOKIE]
    morsel["httponly"] = True
    morsel["samesite"] = "Strict"
    morsel["path"] = "/"
    morsel["max-age"] = max_age
    if secure:
        morsel["secure"] = True
    headers = [(b"location", DASHBOARD.encode()), (b"content-length", b"0"),
               (b"set-cookie", morsel.OutputString().encode("latin-1"))]
    await send({"type": "http.response.start", "status": 303, "headers": headers})
    await send({"type": "http.response.body", "body": b""})


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


def host_name(header: bytes) -> str:
    """The name of a Host header, without its port, lower case (`[::1]:8000` -> `::1`)."""
    host = header.decode("latin-1").strip().lower()
    if host.startswith("["):
        return host[1:].split("]", 1)[0]
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


class AllowedHostsMiddleware:
    """400 for a request whose Host header names another host than the allowed ones: a page
    on another site that rebinds its own name to 127.0.0.1 (DNS rebinding) sends its own name
    as Host, so it cannot reach a server on the operator's machine."""

    def __init__(self, app: ASGIApp, allowed: frozenset[str]) -> None:
        self.app = app
        self.allowed = allowed

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            host = dict(scope["headers"]).get(b"host")
            if host is not None and host_name(host) not in self.allowed:
                await send_error(send, 400, f"the Host header {host.decode('latin-1')!r} is "
                                 "not a name this server answers to (--allowed-hosts)")
                return
        await self.app(scope, receive, send)
