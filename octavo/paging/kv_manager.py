"""Block tables on top of a BlockPool: allocate slots, fork (copy-on-write), free, swap.

The scheduler's side of the contract, on vLLM v1's lines: `get_computed_blocks(seq)` finds a
new sequence's cached prefix (a pure query), then one `allocate_slots(seq, n, cached)` either
gives `n` more tokens their slots and returns the block ids that changed, or returns None and
changes nothing. There is no separate "can I?" question to go stale before the "do it".

Slots are counted as computed when handed out (`seq.num_computed_tokens` moves here and only
here), because the runner writes them in the same step. Copies are only recorded; the runner
moves the KV tensors: swap-out copies first (their sources may be reused right after), then
copy-on-write copies, then swap-in copies, all before the forward pass writes new KV. Blocks
registered in the prefix cache during a step can be hit by a sequence scheduled later in the
same step, so the runner must write all of a step's new KV before attention reads it (a
flattened batch does this per layer).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from octavo.paging.allocator import EMPTY_PREFIX, CachedPrefix, NewBlocks
from octavo.paging.block_pool import BlockPool, KVBlock, OutOfKVBlocks
from octavo.paging.kv_seq import KVSeq
from octavo.paging.waste import check_slot_sum, paged_slot_stats

__all__ = ["KVCacheManager", "OutOfKVBlocks"]


@dataclass(slots=True)
class _Seq:
    seq: KVSeq  # the caller's sequence: its tokens, block hashes and computed-token counter
    blocks: list[KVBlock]  # GPU blocks, or CPU blocks while swapped out
    # Per registered full block: the cache key of an indexed block with the same whole prefix
    # (None when none could be indexed). Its length is the number of blocks registered so far.
    chain_keys: list[int | None]
    swapped: bool = False


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Paged KV cache: per-sequence block tables over shared, ref-counted physical blocks.

    With prefix caching on, every block that fills is registered under its sequence's block
    hash (see block_hash.py); hits are verified against the stored token ids, extra key and
    parent identity as well, so a digest collision can never return the wrong KV.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        enable_prefix_caching: bool = True,
        num_cpu_blocks: int = 0,
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.block_pool = BlockPool(num_blocks, enable_prefix_caching)
        self.cpu_pool = BlockPool(num_cpu_blocks, enable_caching=False)
        self._seqs: dict[int, _Seq] = {}
        self._pending_copies: list[tuple[int, int]] = []
        self.prefix_cache_query_tokens = 0
        self.prefix_cache_hit_tokens = 0

    # -- prefix cache ---------------------------------------------------------------------------
    def get_computed_blocks(self, seq: KVSeq) -> CachedPrefix:
        """Cached blocks covering the longest full-block prefix of a new sequence, leaving at
        least one token to compute. A pure query: no references taken, no stats counted."""
        if not self.enable_prefix_caching:
            return EMPTY_PREFIX
        bs, pool, tokens = self.block_size, self.block_pool, seq.token_ids
        hits: list[KVBlock] = []
        parent_key = 0
        for i in range(min((len(tokens) - 1) // bs, len(seq.block_hashes))):
            toks = tuple(tokens[i * bs : (i + 1) * bs])
            blk = pool.get_cached_block(seq.block_hashes[i], toks, parent_key, seq.extra_key)
            if blk is None:
                break
            hits.append(blk)
            parent_key = blk.cache_key
        return CachedPrefix(tuple(hits), len(hits) * bs)

    def _check_hashes(self, seq: KVSeq, end: int) -> None:
        """Before anything changes: the prefix cache needs the hash of every block that will be
        full, named by a hasher of this block size."""
        if not self.enable_prefix_caching:
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

    def _register_full_blocks(self, state: _Seq) -> None:
        seq, bs = state.seq, self.block_size
        for i in range(len(state.chain_keys), seq.num_computed_tokens // bs):
            toks = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            parent_key = state.chain_keys[-1] if i else 0
            state.chain_keys.append(self._record_full_block(
                state.blocks[i], seq.block_hashes[i], toks, parent_key, seq))

    def _record_full_block(
        self, blk: KVBlock, block_hash: bytes, toks: tuple[int, ...], parent_key: int | None,
        seq: KVSeq,
    ) -> int | None:
        if parent_key is None:  # the prefix is not findable, so this block could never be hit
            blk.token_ids = toks
            return None
        return self.block_pool.cache_full_block(blk, block_hash, toks, parent_key, seq.extra_key)

    # -- allocation -----------------------------------------------------------------------------
    def allocate_slots(
        self,
        seq: KVSeq,
        num_new_tokens: int,
        cached: CachedPrefix | None = None,
        *,
        reserve_tokens: int | None = None,
        final_tokens: int | None = None,
    ) -> NewBlocks | None:
        """Give the next `num_new_tokens` known tokens of `seq` their slots, or return None (and
        change nothing) when the free blocks do not suffice.

        A sequence's first call starts its block table: `cached` (from get_computed_blocks,
        None to compute everything, as prompt logprobs need) is reused and `num_new_tokens`
        counts from its end. Later calls grow the table, copying a shared partial last block
        first (copy-on-write). Returns the block table from the first entry that changed.
        `reserve_tokens` and `final_tokens` are hints for the contiguous baseline; paging
        reserves nothing ahead.
        """
        state = self._seqs.get(seq.seq_id)
        if state is None:
            return self._start(seq, num_new_tokens, cached)
        if state.seq is not seq:
            raise ValueError(f"sequence id {seq.seq_id} already has KV blocks")
        if cached is not None:
            raise ValueError(f"sequence {seq.seq_id} already has blocks: no cached prefix to add")
        if state.swapped:
            raise ValueError(f"sequence {seq.seq_id} is swapped out; swap it in first")
        return self._grow(state, num_new_tokens)

    def _start(
        self, seq: KVSeq, num_new_tokens: int, cached: CachedPrefix | None
    ) -> NewBlocks | None:
        if seq.num_computed_tokens:
            raise ValueError(
                f"sequence {seq.seq_id} counts {seq.num_computed_tokens} computed tokens but "
                "has no KV blocks"
            )
        pool, bs = self.block_pool, self.block_size
        hits = list(cached.blocks) if cached is not None else []
        num_cached = len(hits) * bs
        end = self._checked_end(seq, num_cached, num_new_tokens)
        self._check_hashes(seq, end)
        # A hit on a cached-free block takes it off the free list; a hit on a used one is free.
        needed = sum(blk.ref_cnt == 0 for blk in hits) + _cdiv(end, bs) - len(hits)
        if needed > pool.num_free_blocks:
            return None
        for blk in hits:  # before any get_new_block(), so no hit can be evicted under us
            pool.touch(blk)
        blocks = hits + [pool.get_new_block() for _ in range(_cdiv(end, bs) - len(hits))]
        state = _Seq(seq, blocks, [blk.cache_key for blk in hits])
        self._seqs[seq.seq_id] = state
        seq.num_computed_tokens = num_cached
        self._fill(state, end)
        if self.enable_prefix_caching:
            self._register_full_blocks(state)
            if cached is not None:
                self.prefix_cache_query_tokens += len(seq.token_ids)
                self.prefix_cache_hit_tokens += num_cached
        return NewBlocks(0, [blk.block_id for blk in blocks])

    def _grow(self, state: _Seq, num_new_tokens: int) -> NewBlocks | None:
        seq, pool, bs = state.seq, self.block_pool, self.block_size
        end = self._checked_end(seq, seq.num_computed_tokens, num_new_tokens)
        self._check_hashes(seq, end)
        start = len(state.blocks)
        if num_new_tokens == 0:
            return NewBlocks(start, [])
        copy = self._needs_copy_on_write(state)
        grow = _cdiv(end, bs) - len(state.blocks)
        if grow + copy > pool.num_free_blocks:
            return None
        if copy:
            start = seq.num_computed_tokens // bs
            src = state.blocks[start]
            dst = pool.get_new_block()
            pool.set_filled(dst, src.num_filled)
            pool.free([src])  # still referenced by the sequences it is shared with
            state.blocks[start] = dst
            self._pending_copies.append((src.block_id, dst.block_id))
        for _ in range(grow):
            state.blocks.append(pool.get_new_block())
        self._fill(state, end)
        if self.enable_prefix_caching:
            self._register_full_blocks(state)
        return NewBlocks(start, [blk.block_id for blk in state.blocks[start:]])

    def _checked_end(self, seq: KVSeq, start: int, num_new_tokens: int) -> int:
        end = start + num_new_tokens
        if num_new_tokens < 0 or end > len(seq.token_ids):
            raise ValueError(
                f"cannot compute {num_new_tokens} new tokens after {start} of "
                f"{len(seq.token_ids)} known tokens"
            )
        return end

    def _fill(self, state: _Seq, end: int) -> None:
        bs = self.block_size
        for i in range(state.seq.num_computed_tokens // bs, _cdiv(end, bs)):
            self.block_pool.set_filled(state.blocks[i], min(bs, end - i * bs))
        state.seq.num_computed_tokens = end

    def _needs_copy_on_write(self, state: _Seq) -> bool:
        # The next slot is inside the last block; writing it must not change other sequences' KV.
        n = state.seq.num_computed_tokens
        return n % self.block_size != 0 and state.blocks[n // self.block_size].ref_cnt > 1

    def fork(self, parent_id: int, child: KVSeq) -> None:
        """The child shares all of the parent's blocks; the first write into a shared block
        copies it (see allocate_slots). The child arrives with the parent's tokens, block
        hashes and computed-token count."""
        parent = self._on_gpu(parent_id)
        if child.seq_id in self._seqs:
            raise ValueError(f"sequence {child.seq_id} already has KV blocks")
        if child.num_computed_tokens != parent.seq.num_computed_tokens:
            raise ValueError(
                f"fork of {parent_id}: the child counts {child.num_computed_tokens} computed "
                f"tokens, the parent {parent.seq.num_computed_tokens}"
            )
        for blk in parent.blocks:
            self.block_pool.touch(blk)
        self._seqs[child.seq_id] = _Seq(child, list(parent.blocks), list(parent.chain_keys))

    def free(self, seq_id: int) -> None:
        """Drop a sequence in any state; its computed-token count goes back to 0. Unknown ids are
        ignored: a request aborted while waiting never had blocks. The tail is queued first so
        the shareable prefix is evicted last."""
        state = self._seqs.pop(seq_id, None)
        if state is None:
            return
        pool = self.cpu_pool if state.swapped else self.block_pool
        pool.free(reversed(state.blocks))
        state.seq.num_computed_tokens = 0

    def uncache_from(self, seq_id: int, num_tokens: int) -> None:
        """Forget the prefix-cache entries of this sequence's blocks holding tokens at or after
        `num_tokens`: they were registered when their slots were handed out, and the step that
        was to compute them failed, so nobody may hit them. Call before freeing the sequence."""
        state = self._seqs.get(seq_id)
        if state is None or state.swapped:
            return
        keep = num_tokens // self.block_size
        for blk in state.blocks[keep:]:
            if blk.ref_cnt == 1:  # shared blocks were computed by someone else
                self.block_pool.uncache(blk)
        del state.chain_keys[keep:]

    def take_block_copies(self) -> list[tuple[int, int]]:
        """Pending copy-on-write copies (src, dst), handed over once."""
        copies, self._pending_copies = self._pending_copies, []
        return copies

    # -- swap -----------------------------------------------------------------------------------
    def swap_out(self, seq_ids: Sequence[int]) -> list[tuple[int, int]] | None:
        """Move a group to CPU blocks and return the (gpu_block, cpu_block) copies, or None
        (nothing moves) when the CPU pool is too small. A block shared inside the group is
        copied once and stays shared; its GPU copy stays prefix-cached."""
        states = self._group(seq_ids, swapped=False)
        cpu = self.cpu_pool
        if len({blk.block_id for s in states for blk in s.blocks}) > cpu.num_free_blocks:
            return None
        placed: dict[int, KVBlock] = {}
        copies: list[tuple[int, int]] = []
        for state in states:
            cpu_blocks = []
            for blk in state.blocks:
                dst = placed.get(blk.block_id)
                if dst is None:
                    dst = placed[blk.block_id] = cpu.get_new_block()
                    cpu.set_filled(dst, blk.num_filled)
                    dst.token_ids = blk.token_ids
                    copies.append((blk.block_id, dst.block_id))
                else:
                    cpu.touch(dst)
                cpu_blocks.append(dst)
            self.block_pool.free(reversed(state.blocks))
            state.blocks, state.swapped = cpu_blocks, True
        return copies

    def _swap_in_plan(self, states: list[_Seq]) -> tuple[dict[int, KVBlock | None], int]:
        """For each distinct CPU block: the still-cached GPU block with the very same contents
        (reused without a copy), or None. Also the number of free GPU blocks it takes."""
        reuse: dict[int, KVBlock | None] = {}
        for state in states:
            hashes = state.seq.block_hashes
            for i, cpu_blk in enumerate(state.blocks):
                if cpu_blk.block_id not in reuse:
                    reuse[cpu_blk.block_id] = (
                        self.block_pool.get_block_by_key(hashes[i], state.chain_keys[i])
                        if i < len(state.chain_keys)
                        else None
                    )
        copied = sum(target is None for target in reuse.values())
        revived = {t.block_id for t in reuse.values() if t is not None and t.ref_cnt == 0}
        return reuse, copied + len(revived)

    def swap_in(self, seq_ids: Sequence[int]) -> list[tuple[int, int]] | None:
        """Bring a swapped group back and return the (cpu_block, gpu_block) copies, or None
        (nothing moves) when the free GPU blocks do not suffice."""
        states = self._group(seq_ids, swapped=True)
        pool = self.block_pool
        reuse, needed = self._swap_in_plan(states)
        if needed > pool.num_free_blocks:
            return None
        for target in reuse.values():  # one reference per CPU block, taken before any eviction
            if target is not None:
                pool.touch(target)
        placed: dict[int, tuple[KVBlock, int | None]] = {}
        copies: list[tuple[int, int]] = []
        for state in states:
            seq = state.seq
            gpu_blocks: list[KVBlock] = []
            for i, cpu_blk in enumerate(state.blocks):
                full = i < len(state.chain_keys)
                if cpu_blk.block_id in placed:
                    gpu, key = placed[cpu_blk.block_id]
                    pool.touch(gpu)
                elif (target := reuse[cpu_blk.block_id]) is not None:
                    gpu, key = target, state.chain_keys[i]
                else:
                    gpu, key = pool.get_new_block(), None
                    pool.set_filled(gpu, cpu_blk.num_filled)
                    copies.append((cpu_blk.block_id, gpu.block_id))
                    if full and cpu_blk.token_ids is not None:
                        parent_key = state.chain_keys[i - 1] if i else 0
                        key = self._record_full_block(
                            gpu, seq.block_hashes[i], cpu_blk.token_ids, parent_key, seq
                        )
                placed[cpu_blk.block_id] = (gpu, key)
                if full:
                    state.chain_keys[i] = key
                gpu_blocks.append(gpu)
            self.cpu_pool.free(reversed(state.blocks))
            state.blocks, state.swapped = gpu_blocks, False
        return copies

    # -- queries --------------------------------------------------------------------------------
    def block_table(self, seq_id: int) -> list[int]:
        return [blk.block_id for blk in self._on_gpu(seq_id).blocks]

    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    def usage(self) -> float:
        return self.block_pool.num_used_blocks / self.num_blocks

    def stats(self) -> dict[str, int | float]:
        pool = self.block_pool
        table_entries = sum(len(s.blocks) for s in self._seqs.values() if not s.swapped)
        return {
            "kv_blocks_total": self.num_blocks,
            "kv_blocks_used": pool.num_used_blocks,
            "kv_blocks_cached_free": pool.num_cached_free_blocks,
            **paged_slot_stats(
                block_size=self.block_size,
                num_used_blocks=pool.num_used_blocks,
                num_free_blocks=pool.num_free_blocks,
                live_slots=pool.num_live_slots,
            ),
            "kv_blocks_saved_by_sharing": table_entries - pool.num_used_blocks,
            "prefix_cache_query_tokens": self.prefix_cache_query_tokens,
            "prefix_cache_hit_tokens": self.prefix_cache_hit_tokens,
            "peak_kv_blocks_used": pool.peak_used_blocks,
            "kv_cpu_blocks_total": self.cpu_pool.num_blocks,
            "kv_cpu_blocks_used": self.cpu_pool.num_used_blocks,
        }

    def check_invariants(self) -> None:
        bs = self.block_size
        self.block_pool.check_invariants()
        self.cpu_pool.check_invariants()
        refs = {False: [0] * self.num_blocks, True: [0] * self.cpu_pool.num_blocks}
        for seq_id, state in self._seqs.items():
            seq = state.seq
            computed = seq.num_computed_tokens
            assert seq.seq_id == seq_id, f"seq {seq_id} is filed under another id"
            assert len(state.blocks) == _cdiv(computed, bs), (
                f"seq {seq_id}: {len(state.blocks)} blocks for {computed} tokens "
                f"(paging reserves nothing ahead)"
            )
            assert computed <= len(seq.token_ids), f"seq {seq_id}: computed unknown tokens"
            assert len({id(b) for b in state.blocks}) == len(state.blocks), (
                f"seq {seq_id}: a block appears twice in one block table"
            )
            n_full = computed // bs if self.enable_prefix_caching else 0
            assert len(state.chain_keys) == n_full, (
                f"seq {seq_id}: {len(state.chain_keys)} registered blocks of {n_full} full ones"
            )
            for i, blk in enumerate(state.blocks):
                refs[state.swapped][blk.block_id] += 1
                expect = min(bs, computed - i * bs)
                assert blk.num_filled == expect, (
                    f"seq {seq_id} block {blk.block_id}: {blk.num_filled} slots filled, "
                    f"expected {expect}"
                )
                if blk.block_hash is not None and not state.swapped:
                    assert i < n_full and blk.block_hash == seq.block_hashes[i], (
                        f"seq {seq_id} block {blk.block_id}: cached under another position's hash"
                    )
        for swapped, pool in ((False, self.block_pool), (True, self.cpu_pool)):
            for blk in pool.blocks:
                assert blk.ref_cnt == refs[swapped][blk.block_id], (
                    f"{'CPU' if swapped else 'GPU'} block {blk.block_id}: ref count "
                    f"{blk.ref_cnt} but held by {refs[swapped][blk.block_id]} block tables"
                )
        check_slot_sum(self.stats(), self.num_blocks * bs)

    # -- helpers --------------------------------------------------------------------------------
    def _get(self, seq_id: int) -> _Seq:
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise KeyError(f"sequence {seq_id} has no KV blocks") from None

    def _on_gpu(self, seq_id: int) -> _Seq:
        state = self._get(seq_id)
        if state.swapped:
            raise ValueError(f"sequence {seq_id} is swapped out; swap it in first")
        return state

    def _group(self, seq_ids: Sequence[int], *, swapped: bool) -> list[_Seq]:
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError(f"duplicate sequence ids in {list(seq_ids)}")
        states = [self._get(s) for s in seq_ids]
        for seq_id, state in zip(seq_ids, states, strict=True):
            if state.swapped != swapped:
                what = "already swapped out" if state.swapped else "not swapped out"
                raise ValueError(f"sequence {seq_id} is {what}")
        return states
