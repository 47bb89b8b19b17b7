"""The responses `/v1/responses` keeps (store=true): a bounded, in-memory LRU per server.

A stored entry is the response object as it was sent (what `GET /v1/responses/{id}` answers)
and the chat messages of its conversation, without its instructions (which OpenAI does not
carry over), followed by its output: what a later request's `previous_response_id` continues.
The bound is `--max-stored-responses`; the least recently used entry goes first, so a
conversation that keeps being continued stays. Nothing survives a restart, as in vLLM.

Everything runs on the server's event loop, so no lock is needed.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any
from weakref import WeakKeyDictionary

from octavo.server.context import ServerContext


@dataclass
class StoredResponse:
    response: dict[str, Any]  # the response object, as JSON
    messages: list[dict[str, Any]] = field(default_factory=list)  # the conversation so far


class ResponseStore:
    """At most `max_size` responses by id, least recently used evicted first."""

    def __init__(self, max_size: int) -> None:
        if max_size < 1:
            raise ValueError(f"max_size must be >= 1, got {max_size}")
        self.max_size = max_size
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, response_id: object) -> bool:
        return response_id in self._entries

    def put(self, response_id: str, entry: StoredResponse) -> None:
        self._entries[response_id] = entry
        self._entries.move_to_end(response_id)
        while len(self._entries) > self.max_size:
            self._entries.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> bool:
        return self._entries.pop(response_id, None) is not None


_STORES: WeakKeyDictionary[ServerContext, ResponseStore] = WeakKeyDictionary()


def store_of(ctx: ServerContext) -> ResponseStore:
    """The store of this server, made on first use (one per app: tests run several)."""
    store = _STORES.get(ctx)
    if store is None:
        store = _STORES[ctx] = ResponseStore(ctx.config.max_stored_responses)
    return store
