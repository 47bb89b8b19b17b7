"""The router's FastAPI app: the replicas' API in front, one replica behind each request.

- POST /v1/completions, /v1/chat/completions, /v1/messages, /v1/responses: routed by the
  policy on the prompt's block hashes (prompts.py). A /v1/responses turn that continues a stored
  response (`previous_response_id`) goes to the replica that stored it (asked with GET
  /v1/responses/{id}), whatever the policy says.
- POST /v1/messages/count_tokens, /tokenize, /detokenize: no KV cache involved, routed with no
  prefix (the least loaded replica; round robin under that policy).
- GET /v1/models and /version: the first healthy replica; GET and DELETE
  /v1/responses/{id}: the replica that holds it.
- GET /health (200 while a replica is healthy, else 503; each replica's state in the body) and
  GET /metrics (metrics.py) are the router's own.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from octavo.router.args import RouterConfig
from octavo.router.dispatch import Dispatcher
from octavo.router.metrics import RouterMetrics
from octavo.router.policy import make_policy
from octavo.router.prompts import NO_KEYS, PROMPT_KINDS, PromptHasher, PromptKeys
from octavo.router.proxy import REPLICA_HEADER, ProxyResponse, Route, error_json
from octavo.router.replicas import Replica, ReplicaSet
from octavo.server.errors import install_error_handlers

logger = logging.getLogger(__name__)

PROMPT_PATHS = tuple(PROMPT_KINDS)
PLAIN_POST_PATHS = ("/v1/messages/count_tokens", "/tokenize", "/detokenize")
FIRST_HEALTHY_GET_PATHS = ("/v1/models", "/version")


class TooLarge(Exception):
    pass


async def read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise TooLarge
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise TooLarge
        chunks.append(chunk)
    return b"".join(chunks)


def previous_response_id(body: bytes) -> str | None:
    try:
        value = json.loads(body).get("previous_response_id")
    except (ValueError, AttributeError, UnicodeDecodeError):
        return None
    return value if isinstance(value, str) and value else None


class Router:
    """The app's state: replicas, policy, metrics, the HTTP client, the tokenizing thread."""

    def __init__(self, config: RouterConfig, hasher: PromptHasher) -> None:
        self.config = config
        self.hasher = hasher
        self.replicas = ReplicaSet(config.replicas, config.index_blocks,
                                   config.health_interval)
        self.metrics = RouterMetrics(self.replicas)
        self.dispatcher = Dispatcher(
            self.replicas, make_policy(config.policy,
                                       balance_abs_threshold=config.balance_abs_threshold,
                                       balance_rel_threshold=config.balance_rel_threshold),
            self.metrics, config.block_size, shared_tier=config.kv_tier_shared)
        # one thread: an HF fast tokenizer must not be used by two threads at once
        self.tokenize_pool = ThreadPoolExecutor(max_workers=1,
                                                thread_name_prefix="octavo-router-tokenize")
        self.client: httpx.AsyncClient | None = None

    def start_client(self) -> httpx.AsyncClient:
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(None, connect=self.config.connect_timeout),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=256))
        return self.client

    async def keys(self, path: str, body: bytes) -> PromptKeys:
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self.tokenize_pool, self.hasher.keys, path, body)
        except Exception:  # never fail a request for want of a routing key
            logger.exception("router: hashing a %s prompt failed", path)
            return NO_KEYS

    # ---- routes: exclude -> (replica, reason, matched blocks) ------------------------------
    def by_policy(self, keys: PromptKeys) -> Route:
        def route(exclude: set[int]) -> tuple[Replica, str, int] | None:
            decision = self.dispatcher.pick(keys, exclude)
            if decision is None:
                return None
            return self.dispatcher.replica(decision), decision.reason, decision.matched_blocks
        return route

    def pinned(self, replica: Replica, fallback: Route) -> Route:
        def route(exclude: set[int]) -> tuple[Replica, str, int] | None:
            if replica.healthy and replica.rid not in exclude:
                return replica, "pinned", 0
            return fallback(exclude)
        return route

    def first_healthy(self, exclude: set[int]) -> tuple[Replica, str, int] | None:
        replica = next((r for r in self.replicas.healthy() if r.rid not in exclude), None)
        return None if replica is None else (replica, "first_healthy", 0)

    def proxy(self, request: Request, body: bytes, keys: PromptKeys, route: Route) -> Response:
        assert self.client is not None, "the router's app is not started"
        return ProxyResponse(self.dispatcher, self.client, request.method, request.url.path,
                             request.scope.get("query_string", b""),
                             list(request.headers.raw), body, keys, route)

    async def holder_of(self, response_id: str, request: Request
                        ) -> tuple[Replica | None, httpx.Response | None]:
        """The replica that stores response `response_id` (and its answer), asking each healthy
        replica in turn with the client's headers; (None, the last answer) if none has it."""
        assert self.client is not None
        headers = {k: v for k, v in request.headers.items()
                   if k.lower() in ("authorization", "x-api-key")}
        last = None
        for replica in self.replicas.healthy():
            try:
                resp = await self.client.get(f"{replica.url}/v1/responses/{response_id}",
                                             headers=headers)
            except httpx.HTTPError:
                continue
            if resp.status_code != 404:
                return replica, resp
            last = resp
        return None, last


def build_app(config: RouterConfig, hasher: PromptHasher) -> FastAPI:
    router = Router(config, hasher)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        client = router.start_client()
        await router.replicas.check_all(client)
        checks = asyncio.ensure_future(router.replicas.run(client))
        try:
            yield
        finally:
            checks.cancel()
            await asyncio.gather(checks, return_exceptions=True)
            await client.aclose()
            router.tokenize_pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="octavo router", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.router = router
    install_error_handlers(app)

    @app.get("/health")
    async def health() -> JSONResponse:
        states = [r.state() for r in router.replicas]
        healthy = sum(s["healthy"] for s in states)
        return JSONResponse({"healthy_replicas": healthy, "replicas": states},
                            status_code=200 if healthy else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(router.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    async def routed(request: Request) -> Response:
        path = request.url.path
        try:
            body = await read_body(request, config.max_request_body_bytes)
        except TooLarge:
            return JSONResponse(error_json(path, 413, "the request body is larger than "
                                           f"{config.max_request_body_bytes} bytes"), 413)
        keys = await router.keys(path, body)
        route = router.by_policy(keys)
        if path == "/v1/responses" and (prev := previous_response_id(body)) is not None:
            holder, _ = await router.holder_of(prev, request)
            if holder is not None:
                route = router.pinned(holder, route)
        return router.proxy(request, body, keys, route)

    async def plain(request: Request) -> Response:
        try:
            body = await read_body(request, config.max_request_body_bytes)
        except TooLarge:
            return JSONResponse(error_json(request.url.path, 413, "the request body is "
                                           f"larger than {config.max_request_body_bytes} "
                                           "bytes"), 413)
        return router.proxy(request, body, NO_KEYS, router.by_policy(NO_KEYS))

    async def first_healthy(request: Request) -> Response:
        return router.proxy(request, b"", NO_KEYS, router.first_healthy)

    for path in PROMPT_PATHS:
        app.add_api_route(path, routed, methods=["POST"])
    for path in PLAIN_POST_PATHS:
        app.add_api_route(path, plain, methods=["POST"])
    for path in FIRST_HEALTHY_GET_PATHS:
        app.add_api_route(path, first_healthy, methods=["GET"])

    @app.api_route("/v1/responses/{response_id}", methods=["GET", "DELETE"])
    async def stored_response(response_id: str, request: Request) -> Response:
        holder, answer = await router.holder_of(response_id, request)
        if holder is None:
            if answer is not None:  # every replica said 404: say it as they do
                return Response(answer.content, answer.status_code,
                                media_type=answer.headers.get("content-type"))
            return JSONResponse(error_json(request.url.path, 503, "no healthy replica"), 503)
        if request.method == "GET":
            assert answer is not None
            return Response(answer.content, answer.status_code,
                            media_type=answer.headers.get("content-type"),
                            headers={REPLICA_HEADER: str(holder.rid)})
        return router.proxy(request, b"", NO_KEYS, router.pinned(holder, lambda _: None))

    return app

