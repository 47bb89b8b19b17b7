"""What the KV manager reads and writes of a sequence.

A sequence's progress is one number, `num_computed_tokens`: the leading tokens that have KV
slots. Only the KV manager moves it (allocate_slots hands out slots for tokens computed in the
step being planned; free sets it back to 0), so it can never disagree with the block table.
`block_hashes` names each full block of `token_ids` for the prefix cache; a BlockHasher keeps
it up to date as tokens arrive, so nothing is hashed twice. The engine's Sequence extends this.
`reserve_tokens` is the most tokens the sequence may come to hold: paging ignores it; the
contiguous baseline (baseline/contiguous.py) reserves that much up front.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable

from octavo.paging.block_hash import BlockHasher


class KVSeq:
    __slots__ = ("seq_id", "token_ids", "block_hashes", "extra_key", "num_computed_tokens",
                 "hasher", "reserve_tokens")

    def __init__(
        self,
        seq_id: int,
        token_ids: Iterable[int],
        *,
        hasher: BlockHasher | None = None,
        extra_key: Hashable | None = None,
        block_hashes: list[bytes] | None = None,
        num_computed_tokens: int = 0,
        reserve_tokens: int | None = None,
    ) -> None:
        self.seq_id = seq_id
        self.reserve_tokens = reserve_tokens
        self.token_ids = list(token_ids)
        self.hasher = hasher
        self.extra_key = extra_key
        self.block_hashes = [] if block_hashes is None else block_hashes
        self.num_computed_tokens = num_computed_tokens
        self._hash_new_blocks()

    def child(self, seq_id: int) -> KVSeq:
        """A copy under `seq_id`: these tokens, block hashes and computed-token count (the KV
        manager's fork then shares the blocks with it)."""
        return KVSeq(seq_id, self.token_ids, hasher=self.hasher, extra_key=self.extra_key,
                     block_hashes=list(self.block_hashes),
                     num_computed_tokens=self.num_computed_tokens,
                     reserve_tokens=self.reserve_tokens)

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        if self.hasher is not None and len(self.token_ids) % self.hasher.block_size == 0:
            self._hash_new_blocks()

    def extend(self, token_ids: Iterable[int]) -> None:
        self.token_ids.extend(token_ids)
        self._hash_new_blocks()

    def _hash_new_blocks(self) -> None:
        if self.hasher is not None:
            self.hasher.extend(self.block_hashes, self.token_ids, self.extra_key)

    @property
    def num_new_tokens(self) -> int:
        """Known tokens without KV slots yet: what the next steps must compute."""
        return len(self.token_ids) - self.num_computed_tokens
