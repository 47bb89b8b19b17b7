"""The live page map: GET /dashboard, its snapshot endpoint and its Server-Sent Events feed.

- `GET /v1/kv_map`: one snapshot (engine/kv_map.py builds it on the engine thread between two
  steps), with the server's recent TTFT and inter-token latencies added. The block tables,
  most of a big snapshot, only with `block_tables=true`;
- `GET /v1/kv_map/requests/{id}`: one request's entry with its block tables (the page's hover);
- `GET /v1/kv_map/blocks/{id}`: one block's state and every table entry that holds it;
- `GET /v1/kv_map/stream?hz=4`: the snapshot as Server-Sent Events, `hz` times a second,
  until the client leaves or the server shuts down;
- `GET /dashboard`: one self-contained page (static/dashboard.html: no CDN, no build step)
  that draws the stream.

Every client of the same view shares one snapshot per period (KVMapFeed), so ten open pages
cost the engine what one does. With an API key set, these paths need it like every other
endpoint; a browser, which cannot send a header when it opens a page, opens
`/dashboard?api_key=KEY` once and gets it back as an HttpOnly cookie (middleware.py).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from importlib import resources
from typing import Annotated, Any, Literal, TypeVar

from fastapi import APIRouter, Query
from fastapi.responses import HTMLResponse, Response
from pydantic import BaseModel, Field

from octavo.server.context import ServerContext
from octavo.server.errors import OpenAIError
from octavo.server.openapi import ERROR_REF
from octavo.server.serving_common import SSEResponse

MAX_HZ = 20.0
SNAPSHOT_TIMEOUT_S = 30.0  # a step longer than this is a hung engine, not a slow one
Contiguous = Literal["request", "max_model_len", "none"]
T = TypeVar("T")


class KVMapFeed:
    """The latest encoded snapshot of each view, shared by every client asking within
    `max_age` seconds; one engine call at a time per view."""

    def __init__(self, ctx: ServerContext) -> None:
        self.ctx = ctx
        self._latest: dict[tuple[str, bool], tuple[float, bytes]] = {}
        self._locks: dict[tuple[str, bool], asyncio.Lock] = {}
        self.encode_seconds = 0.0  # event-loop time spent encoding snapshots

    async def get(self, contiguous: str, block_tables: bool = False,
                  max_age: float = 0.0) -> bytes:
        key = (contiguous, block_tables)
        lock = self._locks.setdefault(key, asyncio.Lock())
        async with lock:
            latest = self._latest.get(key)
            if latest is not None and time.monotonic() - latest[0] <= max_age:
                return latest[1]
            view = None if contiguous == "none" else contiguous
            snap = await engine_call(self.ctx, lambda e: e.kv_map(view, block_tables))
            started = time.perf_counter()
            snap["latency"] = self.ctx.metrics.recent_latencies()
            snap["cost"]["encode_seconds"] = self.encode_seconds  # before this one
            body = json.dumps(snap, separators=(",", ":")).encode()
            self.encode_seconds += time.perf_counter() - started
            self._latest[key] = (time.monotonic(), body)
            return body


async def engine_call(ctx: ServerContext, fn: Callable[[Any], T]) -> T:
    """`fn(engine)` on the engine thread between steps; 503 when the engine cannot answer."""
    try:
        return await asyncio.wait_for(ctx.engine.call(fn), SNAPSHOT_TIMEOUT_S)
    except (RuntimeError, TimeoutError) as e:
        raise OpenAIError(503, f"no KV map: {e or 'the engine did not answer'}") from e


class KVPool(BaseModel):
    num_blocks: int
    states: str = Field(description="one character per block, in block-id order; `legend` "
                        "names them")
    legend: dict[str, str]
    counts: dict[str, int] = Field(description="blocks in each state")
    shared_ref_cnt: list[int] = Field(default_factory=list,
                                      description="flat [block id, ref count, ...] of shared "
                                      "blocks")
    partial_filled: list[int] = Field(default_factory=list,
                                      description="flat [block id, filled slots, ...] of "
                                      "blocks in use that are not full")
    tier_saving: list[int] = Field(default_factory=list,
                                   description="with a KV tier: blocks on their way to it "
                                   "(copied out at the next step)")
    tier_loaded: list[int] = Field(default_factory=list,
                                   description="with a KV tier: blocks the last step loaded "
                                   "from it")


class KVMapSeq(BaseModel):
    seq_id: int
    index: int
    output_tokens: int
    computed_tokens: int
    swapped: bool
    num_blocks: int = Field(description="the length of its block table (of each group's)")
    block_tables: list[list[int]] | None = Field(
        None, description="only with block_tables=true, or from /v1/kv_map/requests/{id}: per "
        "KV cache group, logical block -> physical block id (host ids while swapped; -1: "
        "freed out of the sliding window)")


class KVMapRequest(BaseModel):
    request_id: str
    status: Literal["running", "swapped", "waiting"]
    priority: int
    prompt_tokens: int
    cached_tokens: int = Field(description="prompt tokens found in the prefix cache")
    num_preemptions: int
    n: int
    seqs: list[KVMapSeq]


class KVMapBlockHolder(BaseModel):
    request_id: str
    seq_id: int
    group: int
    logical: int = Field(description="the block's index in that sequence's block table")


class KVMapBlock(BaseModel):
    block_id: int
    pool: Literal["device", "host"]
    state: str
    ref_cnt: int
    filled: int
    prefix_cached: bool = Field(description="registered in the prefix cache")
    holders: list[KVMapBlockHolder]


class KVMapContiguous(BaseModel):
    reserve: Literal["request", "max_model_len"]
    states: str
    num_seqs_placed: int
    num_seqs_not_placed: int = Field(description="live sequences a contiguous allocator of "
                                     "the same size could not have held")
    slots: dict[str, int]


class KVMapSnapshot(BaseModel):
    """One consistent snapshot of the KV cache (docs/ARCHITECTURE.md, "The page map")."""

    time: float
    model: str
    block_size: int
    max_model_len: int
    allocator: Literal["paged", "contiguous"]
    kv_cache_groups: int
    prefix_caching: bool
    device: KVPool
    host: KVPool
    requests: list[KVMapRequest] = Field(description="running, swapped, then the head of the "
                                         "waiting queue")
    num_requests: dict[str, int]
    contiguous: KVMapContiguous | None = None
    stats: dict[str, float | str]
    latency: dict[str, float | None]
    cost: dict[str, float] = Field(description="what the page map has cost so far: snapshots "
                                   "built, engine-thread seconds building them, event-loop "
                                   "seconds encoding them")


def dashboard_router(ctx: ServerContext) -> APIRouter:
    router = APIRouter()
    feed = KVMapFeed(ctx)
    page = resources.files("octavo.server").joinpath("static/dashboard.html").read_text()

    @router.get("/v1/kv_map", response_class=Response, responses={
        200: {"model": KVMapSnapshot, "description": "the KV page map now"}})
    async def kv_map(contiguous: Annotated[Contiguous, Query(
            description="the contiguous layout to add: prompt + max_tokens reservations, "
            "max_model_len ones, or none")] = "request",
            block_tables: Annotated[bool, Query(
                description="every sequence's block tables too (the bulk of a big "
                "snapshot)")] = False) -> Response:
        return Response(await feed.get(contiguous, block_tables), media_type="application/json")

    @router.get("/v1/kv_map/requests/{request_id}", response_model=KVMapRequest,
                responses={404: {"description": "no such request in flight",
                                 "content": {"application/json": {"schema": ERROR_REF}}}})
    async def kv_map_request(request_id: str) -> dict[str, Any]:
        entry = await engine_call(ctx, lambda e: e.kv_map_request(request_id))
        if entry is None:
            raise OpenAIError(404, f"no request {request_id!r} is in flight", "request_id")
        return entry

    @router.get("/v1/kv_map/blocks/{block_id}", response_model=KVMapBlock)
    async def kv_map_block(block_id: int, pool: Literal["device", "host"] = "device"
                           ) -> dict[str, Any]:
        try:
            return await engine_call(ctx, lambda e: e.kv_map_block(block_id, pool == "host"))
        except ValueError as e:
            raise OpenAIError(400, str(e), "block_id") from e

    @router.get("/v1/kv_map/stream", include_in_schema=False)
    async def kv_map_stream(hz: Annotated[float, Query(gt=0, le=MAX_HZ)] = 4.0,
                            contiguous: Contiguous = "request") -> Response:
        period = 1.0 / hz

        async def events() -> AsyncIterator[str]:
            while ctx.engine.accepting:  # a client that left fails the next write
                started = time.monotonic()
                try:
                    body = await feed.get(contiguous, max_age=period / 2)
                except OpenAIError:
                    return
                yield "data: " + body.decode() + "\n\n"
                await asyncio.sleep(max(period - (time.monotonic() - started), 0.0))

        return SSEResponse(events(), on_close=lambda: None)

    @router.get("/dashboard", include_in_schema=False)
    async def dashboard() -> HTMLResponse:
        return HTMLResponse(page, headers={"Cache-Control": "no-cache"})

    return router
