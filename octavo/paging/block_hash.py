"""Chained block hashes for automatic prefix caching.

A full block is named by hash(parent block hash, its token ids, extra key), so equal names mean
equal prefixes, not just equal blocks. The digest is 128-bit blake2b over a fixed-layout encoding
(16-byte parent digest, the tokens as int64, then repr(extra_key)), which makes accidental
collisions vanishingly rare; the block pool still verifies token ids, extra key and parent
identity on every hit, so even a colliding digest can never hand out the wrong KV (except at
the first block of a sliding-window hit where every layer slides: see kv_tier_io.py and
prefix_cache.py).

A hasher's `seed` names what the blocks hold beyond their tokens, the KV cache's storage format
(`kv_cache_dtype`): it replaces the all-zero parent of a sequence's first block, so every hash
of the chain differs between formats, and an int8 page is never found under a key of a
model-dtype page (or the other way round) by anything that shares hashes between engines.
None (the model dtype) keeps the hashes as they always were.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Hashable, Sequence

DIGEST_SIZE = 16
ROOT_PARENT = bytes(DIGEST_SIZE)


def hash_block_tokens(
    parent_hash: bytes | None, token_ids: Sequence[int], extra_key: Hashable | None = None
) -> bytes:
    h = hashlib.blake2b(
        ROOT_PARENT if parent_hash is None else parent_hash, digest_size=DIGEST_SIZE
    )
    h.update(array("q", token_ids).tobytes())
    h.update(repr(extra_key).encode())
    return h.digest()


class BlockHasher:
    """Extends a sequence's list of block hashes as its tokens fill blocks: each full block is
    hashed once, when it fills, never again on later admission attempts or steps."""

    __slots__ = ("block_size", "root")

    def __init__(self, block_size: int, seed: str | None = None) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        # the parent of a sequence's first block
        self.root = ROOT_PARENT if seed is None else hashlib.blake2b(
            seed.encode(), digest_size=DIGEST_SIZE).digest()

    def extend(
        self, block_hashes: list[bytes], token_ids: Sequence[int], extra_key: Hashable | None
    ) -> None:
        bs = self.block_size
        n = len(block_hashes)
        while (n + 1) * bs <= len(token_ids):
            parent = block_hashes[n - 1] if n else self.root
            block_hashes.append(hash_block_tokens(parent, token_ids[n * bs : (n + 1) * bs],
                                                  extra_key))
            n += 1
