"""The prefix cache over a block pool: full blocks registered under their chained hash as they
fill, and a new sequence's cached prefix found again (`lookup`).

Each KV cache group indexes its blocks under its own name for the same prefix. Hits are
verified against the stored token ids, extra key and parent identity as well as the digest, so
a collision can never return the wrong KV. The one exception: where every group slides
(Mistral), the first block of a window hit has no parent left to check, and only its 128-bit
digest vouches for the prefix before it. `lookup` is a pure query (no references taken); the
KV manager takes the references when it starts the sequence, and counts the hit here.

With a KV tier (tier/), a block the pool misses may be found there: the prefix then names it
as a `TierBlock`, which the KV manager loads into a fresh block. A tier block is named by its
chained digest (checked against the record's key and token ids when it is read), so once a
group's prefix leaves the pool it continues in the tier only: a pool block after it could not
be checked against its parent.
"""

from __future__ import annotations

from octavo.paging.allocator import CachedPrefix
from octavo.paging.block_pool import BlockPool, KVBlock
from octavo.paging.group_windows import GroupWindows
from octavo.paging.kv_seq import KVSeq
from octavo.paging.seq_blocks import SeqBlocks
from octavo.paging.tier.kv_tier import KVTier, TierBlock

Hit = KVBlock | TierBlock


class PrefixCache:
    def __init__(self, pool: BlockPool, groups: GroupWindows, enabled: bool) -> None:
        self.pool = pool
        self.groups = groups
        self.block_size = groups.block_size
        self.enabled = enabled
        self.query_tokens = 0  # prompt tokens of the sequences that looked up a prefix
        self.hit_tokens = 0  # of them, the tokens a hit covered
        self.tier: KVTier | None = None  # the KV manager sets it where there is a tier
        self._tier_seen: dict[bytes, bool] = {}  # one lookup's answers from the tier
        self._no_hit = CachedPrefix(((),) * groups.num_groups, 0)

    def key(self, block_hash: bytes, group: int) -> bytes:
        """The name group `group` indexes a block of this hash under."""
        return block_hash if group == 0 else block_hash + group.to_bytes(2, "little")

    def block_tokens(self, seq: KVSeq, i: int) -> tuple[int, ...]:
        bs = self.block_size
        return tuple(seq.token_ids[i * bs : (i + 1) * bs])

    def count_hit(self, seq: KVSeq, num_cached: int) -> None:
        self.query_tokens += len(seq.token_ids)
        self.hit_tokens += num_cached

    # -- registering ----------------------------------------------------------------------------
    def check_hashes(self, seq: KVSeq, end: int) -> None:
        """Before anything changes: registering needs the hash of every block that will be
        full, named by a hasher of this block size."""
        if not self.enabled:
            return
        bs = self.block_size
        if seq.hasher is not None and seq.hasher.block_size != bs:
            raise ValueError(f"sequence {seq.seq_id} hashes blocks of {seq.hasher.block_size} "
                             f"tokens, the KV cache has blocks of {bs}")
        if len(seq.block_hashes) < end // bs:
            raise ValueError(
                f"sequence {seq.seq_id} has no hash for its full block {len(seq.block_hashes)}: "
                f"give it a BlockHasher({bs}) when prefix caching is on"
            )

    def register_full_blocks(self, state: SeqBlocks) -> None:
        """Index every block of the sequence that filled since the last call."""
        if not self.enabled:
            return
        seq, bs = state.seq, self.block_size
        for g in self.groups.order:
            keys, table = state.chain_keys[g], state.blocks[g]
            for i in range(len(keys), seq.num_computed_tokens // bs):
                blk = table[i]
                assert blk is not None, f"seq {seq.seq_id}: registering a freed block"
                keys.append(self.record_full_block(
                    blk, self.key(seq.block_hashes[i], g), self.block_tokens(seq, i),
                    self.parent_key(state, g, i), seq))

    def record_full_block(self, blk: KVBlock, block_hash: bytes, toks: tuple[int, ...],
                          parent_key: int | None, seq: KVSeq) -> int | None:
        """Index one full block; its cache key (None: its prefix is not findable, so the
        block could never be hit)."""
        if parent_key is None:
            blk.token_ids = toks
            return None
        return self.pool.cache_full_block(blk, block_hash, toks, parent_key, seq.extra_key)

    def parent_key(self, state: SeqBlocks, g: int, i: int) -> int | None:
        """What block i of group g chains onto when it is registered: the block before it in
        a full-attention group (and where every group slides), the anchor's block at the same
        position in a sliding group of a hybrid model."""
        anchor = self.groups.anchor
        if self.groups.windows[g] is None or anchor is None:
            return state.chain_keys[g][i - 1] if i else 0
        return state.chain_keys[anchor][i]

    # -- finding --------------------------------------------------------------------------------
    def lookup(self, seq: KVSeq) -> CachedPrefix:
        """Cached blocks covering the longest full-block prefix of a new sequence that every
        group can resume from, leaving at least one token to compute. A full-attention group
        needs every block of the prefix, a sliding group only those its window still sees."""
        if not self.enabled:
            return self._no_hit
        self._tier_seen.clear()
        windows = self.groups.windows
        n = min((len(seq.token_ids) - 1) // self.block_size, len(seq.block_hashes))
        found: list[list[Hit | None]] = [[] for _ in windows]
        while True:  # each group may shorten the hit; stop when none does
            before = n
            for g in self.groups.order:
                if windows[g] is None:
                    found[g] = self._full_hits(seq, g, n)
                else:
                    anchor = self.groups.anchor
                    found[g] = self._window_hits(seq, g, n,
                                                 None if anchor is None else found[anchor])
                n = min(n, len(found[g]))
            if n == before:
                break
        if n == 0:
            return self._no_hit
        return CachedPrefix(tuple(tuple(hits[:n]) for hits in found), n * self.block_size)

    def _in_tier(self, key: bytes) -> bool:
        if self.tier is None:
            return False
        seen = self._tier_seen.get(key)
        if seen is None:
            seen = self._tier_seen[key] = self.tier.contains(key)
        return seen

    def _full_hits(self, seq: KVSeq, g: int, n: int) -> list[Hit | None]:
        """The leading blocks of `seq` cached in `g`, each chained onto the one before (in the
        pool), then those the tier holds (asked once for the rest of the prefix)."""
        hits: list[Hit | None] = []
        parent_key = 0
        for i in range(n):
            blk = self.pool.get_cached_block(self.key(seq.block_hashes[i], g),
                                             self.block_tokens(seq, i), parent_key,
                                             seq.extra_key)
            if blk is None:
                break
            hits.append(blk)
            parent_key = blk.cache_key
        if self.tier is not None and len(hits) < n:
            keys = [self.key(seq.block_hashes[i], g) for i in range(len(hits), n)]
            found = self._tier_seen_leading(keys)
            hits += [TierBlock(k) for k in keys[:found]]
        return hits

    def _tier_seen_leading(self, keys: list[bytes]) -> int:
        """count_leading, remembered for the rest of this lookup (its loop asks again)."""
        assert self.tier is not None
        n = 0
        while n < len(keys) and self._tier_seen.get(keys[n]):
            n += 1
        if n < len(keys) and keys[n] not in self._tier_seen:
            found = self.tier.count_leading(keys[n:])
            for k in keys[n:n + found]:
                self._tier_seen[k] = True
            if n + found < len(keys):
                self._tier_seen[keys[n + found]] = False
            n += found
        return n

    def _window_hits(self, seq: KVSeq, g: int, n: int,
                     anchor: list[Hit | None] | None) -> list[Hit | None]:
        """The longest prefix of at most `n` blocks whose blocks in `g`'s window of the next
        query are all cached (None before the window), scanning from the right once.

        In a hybrid model each sliding block was registered as the child of the anchor group's
        block at the same position, whose chain vouches for the whole prefix (where that block
        comes from the tier, so must this one). Where every group slides, consecutive pool hits
        must chain onto each other; the first block of the window is named by its prefix's
        digest alone (the blocks before it are gone)."""
        end = n
        hits: dict[int, Hit] = {}  # verified so far, by block index
        while end > 0:
            first = self.groups.first_live(g, end * self.block_size)
            for i in range(end - 1, first - 1, -1):
                blk = hits.get(i)
                if blk is None:
                    key = self.key(seq.block_hashes[i], g)
                    a = None if anchor is None else anchor[i]
                    if not isinstance(a, TierBlock):
                        parent = None if a is None else a.cache_key
                        blk = self.pool.get_cached_block(key, self.block_tokens(seq, i), parent,
                                                         seq.extra_key)
                    if blk is None and self._in_tier(key):
                        blk = TierBlock(key)
                if blk is None:
                    end = i  # no hit may include block i
                    break
                nxt = hits.get(i + 1) if i + 1 < end else None
                if (anchor is None and isinstance(blk, KVBlock) and isinstance(nxt, KVBlock)
                        and nxt.parent_key != blk.cache_key):
                    end = i + 1  # blocks i and i + 1 do not chain: a hit may end at i + 1
                    break
                hits[i] = blk
            else:
                return [hits[j] if j >= first else None for j in range(end)]
        return []
