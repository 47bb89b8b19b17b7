"""The replicas behind the router: their health, load and the router's index of each.

A replica is healthy while its `/health` answers 200 (`octavo serve` answers 503 once it drains
or its engine thread died). Every replica is checked at start and then every `interval`
seconds; a replica that refuses a connection is marked down at once (the proxy's report), so it
gets no traffic until a check finds it up again. A replica that comes back after being down is
a fresh process for all the router knows: its index starts empty.

When the router is given no `--index-blocks`, a replica's index is sized, once it is first
healthy, to the KV blocks the replica reports in `/metrics` (`octavo:kv_blocks_total`); the
replicas' max_model_len (for the router's prompt bounds) is read from the first healthy
one's `/v1/models` unless given.

A replica that answers nothing (not even 503) for `timeout` seconds is hung: a frozen process
still accepts connections, so without this its requests would wait for ever. Every request in
flight on it is cut (its `cuts`: the proxy ends it with an error) and it gets no new ones until
it answers again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from octavo.router.args import DEFAULT_INDEX_BLOCKS
from octavo.router.prefix_index import PrefixIndex

logger = logging.getLogger(__name__)

KV_BLOCKS_METRIC = "octavo:kv_blocks_total"


@dataclass(eq=False)
class Replica:
    rid: int  # position in the router's list: round robin's order, the tie-breaker
    url: str
    index: PrefixIndex
    healthy: bool = False
    in_flight: int = 0
    last_error: str | None = "not checked yet"
    kv_blocks: int | None = None  # from its /metrics
    was_up: bool = field(default=False, repr=False)
    last_answer: float = field(default_factory=time.monotonic, repr=False)
    # one per request in flight on it: ends that request with an error (a hung replica)
    cuts: set[Callable[[str], None]] = field(default_factory=set, repr=False)

    def state(self) -> dict[str, Any]:
        return {"url": self.url, "healthy": self.healthy, "in_flight": self.in_flight,
                "error": None if self.healthy else self.last_error,
                "kv_blocks": self.kv_blocks, "index_blocks": len(self.index),
                "index_capacity": self.index.capacity}


def kv_blocks_of(metrics_text: str) -> int | None:
    for family in text_string_to_metric_families(metrics_text):
        if family.name == KV_BLOCKS_METRIC and family.samples:
            return int(sum(s.value for s in family.samples))
    return None


class ReplicaSet:
    def __init__(self, urls: list[str], index_blocks: int | None = None,
                 interval: float = 2.0, timeout: float = 60.0,
                 headers: dict[str, str] | None = None,
                 on_max_model_len: Callable[[int], None] | None = None) -> None:
        """`headers`: sent with the router's own requests (its API key, which the replicas
        share); `on_max_model_len`: told the replicas' max_model_len once it is known."""
        self.fixed_capacity = index_blocks is not None
        cap = index_blocks if index_blocks is not None else DEFAULT_INDEX_BLOCKS
        self.replicas = [Replica(i, url, PrefixIndex(cap)) for i, url in enumerate(urls)]
        self.interval = interval
        self.timeout = timeout
        self.headers = headers or {}
        self.on_max_model_len = on_max_model_len

    def __iter__(self):
        return iter(self.replicas)

    def __len__(self) -> int:
        return len(self.replicas)

    def healthy(self) -> list[Replica]:
        return [r for r in self.replicas if r.healthy]

    def by_url(self, url: str) -> Replica | None:
        return next((r for r in self.replicas if r.url == url), None)

    def mark_down(self, replica: Replica, reason: str) -> None:
        if replica.healthy:
            logger.warning("router: replica %s is down: %s", replica.url, reason)
        replica.healthy = False
        replica.last_error = reason

    def mark_up(self, replica: Replica) -> None:
        if not replica.healthy:
            if replica.was_up:  # back after being down: a restarted replica's cache is empty
                replica.index.clear()
            logger.info("router: replica %s is up", replica.url)
        replica.healthy = replica.was_up = True
        replica.last_error = None

    async def check(self, client: httpx.AsyncClient, replica: Replica) -> None:
        try:
            resp = await client.get(f"{replica.url}/health", timeout=self.interval + 1.0)
        except httpx.HTTPError as e:
            self.mark_down(replica, f"{type(e).__name__}: {e}" if str(e) else type(e).__name__)
            self.cut_if_hung(replica)
            return
        replica.last_answer = time.monotonic()
        if resp.status_code != 200:
            self.mark_down(replica, f"/health answered {resp.status_code}")
            return
        if replica.kv_blocks is None:
            await self.read_kv_blocks(client, replica)
        if self.on_max_model_len is not None:
            await self.read_max_model_len(client, replica)
        self.mark_up(replica)

    def cut_if_hung(self, replica: Replica) -> None:
        silent = time.monotonic() - replica.last_answer
        if silent >= self.timeout and replica.cuts:
            logger.warning("router: replica %s has answered nothing for %.0f s; ending its %d "
                           "requests in flight", replica.url, silent, len(replica.cuts))
            for cut in list(replica.cuts):
                cut(f"replica {replica.rid} stopped answering")

    async def read_kv_blocks(self, client: httpx.AsyncClient, replica: Replica) -> None:
        with contextlib.suppress(httpx.HTTPError, ValueError):
            resp = await client.get(f"{replica.url}/metrics", timeout=self.interval + 1.0,
                                    headers=self.headers)
            if resp.status_code == 200:
                replica.kv_blocks = kv_blocks_of(resp.text)
        if replica.kv_blocks and not self.fixed_capacity:
            replica.index.resize(replica.kv_blocks)

    async def read_max_model_len(self, client: httpx.AsyncClient, replica: Replica) -> None:
        with contextlib.suppress(httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
            resp = await client.get(f"{replica.url}/v1/models", timeout=self.interval + 1.0,
                                    headers=self.headers)
            if resp.status_code == 200 and self.on_max_model_len is not None:
                self.on_max_model_len(int(resp.json()["data"][0]["max_model_len"]))
                self.on_max_model_len = None

    async def check_all(self, client: httpx.AsyncClient) -> None:
        await asyncio.gather(*(self.check(client, r) for r in self.replicas))

    async def run(self, client: httpx.AsyncClient) -> None:
        """Check every replica every `interval` seconds, until cancelled."""
        while True:
            await asyncio.sleep(self.interval)
            await self.check_all(client)
