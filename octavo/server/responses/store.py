"""The responses `/v1/responses` keeps (store=true): a bounded, in-memory LRU per server.

A stored entry is the response object as it was sent (what `GET /v1/responses/{id}` answers)
and the chat messages of its conversation, without its instructions (which OpenAI does not
carry over), followed by its output: what a later request's `previous_response_id` continues.
The bounds are `--max-stored-responses` entries and `--max-stored-response-bytes` bytes (an
entry's size is its JSON's: each entry holds its whole conversation, so a long one weighs
much); the least recently used entry goes first, so a conversation that keeps being continued
stays. An entry larger than the whole byte bound is not kept. Nothing survives a restart, as
in vLLM.

Everything runs on the server's event loop, so no lock is needed.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any
from weakref import WeakKeyDictionary

from octavo.server.context import ServerContext


@dataclass
class StoredResponse:
    response: dict[str, Any]  # the response object, as JSON
    messages: list[dict[str, Any]] = field(default_factory=list)  # the conversation so far


def entry_bytes(entry: StoredResponse) -> int:
    return len(json.dumps([entry.response, entry.messages], ensure_ascii=False,
                          separators=(",", ":")).encode())


class ResponseStore:
    """At most `max_size` responses by id and `max_bytes` bytes of them, least recently used
    evicted first."""

    def __init__(self, max_size: int, max_bytes: int | None = None) -> None:
        if max_size < 1:
            raise ValueError(f"max_size must be >= 1, got {max_size}")
        if max_bytes is not None and max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
        self.max_size = max_size
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._sizes: dict[str, int] = {}
        self.num_bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, response_id: object) -> bool:
        return response_id in self._entries

    def put(self, response_id: str, entry: StoredResponse) -> bool:
        """Keep `entry` (False: it alone is larger than max_bytes, and is not kept)."""
        self.delete(response_id)
        size = entry_bytes(entry) if self.max_bytes is not None else 0
        if self.max_bytes is not None and size > self.max_bytes:
            return False
        self._entries[response_id] = entry
        self._sizes[response_id] = size
        self.num_bytes += size
        while len(self._entries) > self.max_size or (
                self.max_bytes is not None and self.num_bytes > self.max_bytes):
            oldest, _ = self._entries.popitem(last=False)
            self.num_bytes -= self._sizes.pop(oldest)
        return True

    def get(self, response_id: str) -> StoredResponse | None:
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> bool:
        if self._entries.pop(response_id, None) is None:
            return False
        self.num_bytes -= self._sizes.pop(response_id)
        return True


_STORES: WeakKeyDictionary[ServerContext, ResponseStore] = WeakKeyDictionary()


def store_of(ctx: ServerContext) -> ResponseStore:
    """The store of this server, made on first use (one per app: tests run several)."""
    store = _STORES.get(ctx)
    if store is None:
        store = _STORES[ctx] = ResponseStore(ctx.config.max_stored_responses,
                                             ctx.config.max_stored_response_bytes)
    return store
