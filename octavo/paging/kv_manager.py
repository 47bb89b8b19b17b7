"""Block tables on top of a BlockPool: allocate, append, fork (copy-on-write), free, swap.

One number drives a sequence: `num_computed`, the tokens whose slots it has been given. Prefill,
chunked prefill, decode and prefix hits are all "advance num_computed by n": allocate() starts it
at the cached prefix, append_slots() moves it on. Slots are counted as computed when handed out,
because the runner writes them in the same step.

Copies are only recorded here; the runner moves the KV tensors. Within one step it should apply
swap-out copies first (their sources may be reused right after), then copy-on-write copies, then
swap-in copies, all before the forward pass writes new KV. Blocks registered in the prefix cache
during a step can be hit by a sequence scheduled later in the same step, so the runner must write
all of a step's new KV before attention reads it (a flattened batch does this per layer).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from octavo.paging.block_hash import hash_block_tokens
from octavo.paging.block_pool import BlockPool, KVBlock, OutOfKVBlocks
from octavo.paging.waste import check_slot_sum, paged_slot_stats

__all__ = ["KVCacheManager", "OutOfKVBlocks"]


@dataclass(slots=True)
class _Seq:
    blocks: list[KVBlock]  # GPU blocks, or CPU blocks while swapped out
    num_computed: int
    extra_key: Hashable | None
    # One entry per full block, computed once when the block fills: its chained hash, and the
    # cache key of an indexed block with the same whole prefix (None when none could be indexed).
    block_hashes: list[bytes] = field(default_factory=list)
    chain_keys: list[int | None] = field(default_factory=list)
    swapped: bool = False


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Paged KV cache: per-sequence block tables over shared, ref-counted physical blocks.

    With prefix caching on, every block that fills is named by a chained 128-bit blake2b digest
    (see block_hash.py) and registered; hits are verified against the stored token ids, extra
    key and parent identity as well, so a digest collision can never return the wrong KV.
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
    def _match_prefix(
        self, token_ids: Sequence[int], extra_key: Hashable | None
    ) -> tuple[list[KVBlock], list[bytes]]:
        """Cached blocks covering the longest full-block prefix, leaving >= 1 token to compute,
        and the hashes computed on the way (one past the hits on a miss, so none is redone)."""
        if not self.enable_prefix_caching:
            return [], []
        bs, pool = self.block_size, self.block_pool
        hits: list[KVBlock] = []
        hashes: list[bytes] = []
        parent_key = 0
        for i in range((len(token_ids) - 1) // bs):
            toks = tuple(token_ids[i * bs : (i + 1) * bs])
            hashes.append(hash_block_tokens(hashes[-1] if i else None, toks, extra_key))
            blk = pool.get_cached_block(hashes[-1], toks, parent_key, extra_key)
            if blk is None:
                break
            hits.append(blk)
            parent_key = blk.cache_key
        return hits, hashes

    def find_cached_prefix(
        self, token_ids: Sequence[int], extra_key: Hashable | None = None
    ) -> int:
        """Leading tokens already in cached full blocks (a pure query: no refs, no stats)."""
        return len(self._match_prefix(token_ids, extra_key)[0]) * self.block_size

    def _register_full_blocks(
        self, seq: _Seq, token_ids: Sequence[int], known_hashes: Sequence[bytes] = ()
    ) -> None:
        bs = self.block_size
        for i in range(len(seq.block_hashes), seq.num_computed // bs):
            toks = tuple(token_ids[i * bs : (i + 1) * bs])
            if i < len(known_hashes):
                block_hash = known_hashes[i]
            else:
                parent_hash = seq.block_hashes[-1] if i else None
                block_hash = hash_block_tokens(parent_hash, toks, seq.extra_key)
            seq.block_hashes.append(block_hash)
            parent_key = seq.chain_keys[-1] if i else 0
            seq.chain_keys.append(
                self._record_full_block(seq.blocks[i], block_hash, toks, parent_key, seq.extra_key)
            )

    def _record_full_block(
        self,
        blk: KVBlock,
        block_hash: bytes,
        toks: tuple[int, ...],
        parent_key: int | None,
        extra_key: Hashable | None,
    ) -> int | None:
        if parent_key is None:  # the prefix is not findable, so this block could never be hit
            blk.token_ids = toks
            return None
        return self.block_pool.cache_full_block(blk, block_hash, toks, parent_key, extra_key)

    # -- allocation -----------------------------------------------------------------------------
    def _fresh_blocks_for_new_seq(self, hits: list[KVBlock], end: int) -> int:
        # A hit on a cached-free block takes it off the free list; a hit on a used block is free.
        return sum(blk.ref_cnt == 0 for blk in hits) + _cdiv(end, self.block_size) - len(hits)

    def _checked_end(self, token_ids: Sequence[int], start: int, num_new_tokens: int) -> int:
        end = start + num_new_tokens
        if num_new_tokens < 0 or end > len(token_ids):
            raise ValueError(
                f"cannot compute {num_new_tokens} new tokens after {start} of {len(token_ids)} "
                f"known tokens"
            )
        return end

    def can_allocate(
        self,
        token_ids: Sequence[int],
        num_new_tokens: int,
        extra_key: Hashable | None = None,
        *,
        reserve_tokens: int | None = None,
        use_prefix_cache: bool = True,
    ) -> bool:
        hits, _ = self._match_prefix(token_ids, extra_key) if use_prefix_cache else ([], [])
        end = self._checked_end(token_ids, len(hits) * self.block_size, num_new_tokens)
        return self._fresh_blocks_for_new_seq(hits, end) <= self.block_pool.num_free_blocks

    def allocate(
        self,
        seq_id: int,
        token_ids: Sequence[int],
        num_new_tokens: int,
        extra_key: Hashable | None = None,
        *,
        reserve_tokens: int | None = None,
        final_tokens: int | None = None,
        use_prefix_cache: bool = True,
    ) -> int:
        """Start a sequence: reuse its cached prefix, then give slots to `num_new_tokens` more.

        `num_new_tokens` counts from the end of the cached prefix (ask find_cached_prefix first
        when chunking). Returns the cached prefix length. `reserve_tokens` and `final_tokens` are
        hints for the contiguous baseline; paging reserves nothing ahead. `use_prefix_cache=False`
        computes the whole prompt (prompt logprobs need every position's logits); its full
        blocks are still registered for others to hit.
        """
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id} already has KV blocks")
        pool, bs = self.block_pool, self.block_size
        hits, hashes = self._match_prefix(token_ids, extra_key) if use_prefix_cache else ([], [])
        num_cached = len(hits) * bs
        end = self._checked_end(token_ids, num_cached, num_new_tokens)
        needed = self._fresh_blocks_for_new_seq(hits, end)
        if needed > pool.num_free_blocks:
            raise self._out_of_blocks(needed, f"allocate sequence {seq_id}")
        for blk in hits:  # before any get_new_block(), so no hit can be evicted under us
            pool.touch(blk)
        blocks = hits + [pool.get_new_block() for _ in range(_cdiv(end, bs) - len(hits))]
        seq = _Seq(
            blocks,
            num_cached,
            extra_key,
            hashes[: len(hits)],
            [blk.cache_key for blk in hits],
        )
        self._seqs[seq_id] = seq
        self._fill(seq, end)
        if self.enable_prefix_caching:
            self._register_full_blocks(seq, token_ids, hashes)
            if use_prefix_cache:
                self.prefix_cache_query_tokens += len(token_ids)
                self.prefix_cache_hit_tokens += num_cached
        return num_cached

    def _fill(self, seq: _Seq, end: int) -> None:
        bs = self.block_size
        for i in range(seq.num_computed // bs, _cdiv(end, bs)):
            self.block_pool.set_filled(seq.blocks[i], min(bs, end - i * bs))
        seq.num_computed = end

    def _needs_copy_on_write(self, seq: _Seq) -> bool:
        # The next slot is inside the last block; writing it must not change other sequences' KV.
        n = seq.num_computed
        return n % self.block_size != 0 and seq.blocks[n // self.block_size].ref_cnt > 1

    def _fresh_blocks_to_append(self, seq: _Seq, num_new_tokens: int) -> int:
        if num_new_tokens == 0:
            return 0
        grow = _cdiv(seq.num_computed + num_new_tokens, self.block_size) - len(seq.blocks)
        return grow + self._needs_copy_on_write(seq)

    def num_blocks_needed(self, seq_id: int, num_new_tokens: int) -> int:
        """Free blocks append_slots would take (growth plus a copy-on-write copy); for the
        scheduler to ask whether a whole group of sequences fits before touching any."""
        return self._fresh_blocks_to_append(self._on_gpu(seq_id), num_new_tokens)

    def can_append_slots(self, seq_id: int, num_new_tokens: int) -> bool:
        seq = self._on_gpu(seq_id)
        return self._fresh_blocks_to_append(seq, num_new_tokens) <= self.block_pool.num_free_blocks

    def append_slots(self, seq_id: int, token_ids: Sequence[int], num_new_tokens: int) -> None:
        """Give slots to the next `num_new_tokens` tokens; `token_ids` is every known token."""
        seq = self._on_gpu(seq_id)
        pool = self.block_pool
        end = self._checked_end(token_ids, seq.num_computed, num_new_tokens)
        needed = self._fresh_blocks_to_append(seq, num_new_tokens)
        if needed > pool.num_free_blocks:
            raise self._out_of_blocks(needed, f"append {num_new_tokens} slots to {seq_id}")
        if num_new_tokens == 0:
            return
        if self._needs_copy_on_write(seq):
            idx = seq.num_computed // self.block_size
            src = seq.blocks[idx]
            dst = pool.get_new_block()
            pool.set_filled(dst, src.num_filled)
            pool.free([src])  # still referenced by the sequences it is shared with
            seq.blocks[idx] = dst
            self._pending_copies.append((src.block_id, dst.block_id))
        for _ in range(_cdiv(end, self.block_size) - len(seq.blocks)):
            seq.blocks.append(pool.get_new_block())
        self._fill(seq, end)
        if self.enable_prefix_caching:
            self._register_full_blocks(seq, token_ids)

    def fork(self, parent_id: int, child_id: int) -> None:
        """The child shares all of the parent's blocks; the first write into a shared block
        copies it (see append_slots)."""
        parent = self._on_gpu(parent_id)
        if child_id in self._seqs:
            raise ValueError(f"sequence {child_id} already has KV blocks")
        for blk in parent.blocks:
            self.block_pool.touch(blk)
        self._seqs[child_id] = _Seq(
            list(parent.blocks),
            parent.num_computed,
            parent.extra_key,
            list(parent.block_hashes),
            list(parent.chain_keys),
        )

    def free(self, seq_id: int) -> None:
        """Drop a sequence in any state. Unknown ids are ignored: a request aborted while waiting
        never had blocks. The tail is queued first so the shareable prefix is evicted last."""
        seq = self._seqs.pop(seq_id, None)
        if seq is None:
            return
        pool = self.cpu_pool if seq.swapped else self.block_pool
        pool.free(reversed(seq.blocks))

    def uncache_from(self, seq_id: int, num_tokens: int) -> None:
        """Forget the prefix-cache entries of this sequence's blocks holding tokens at or after
        `num_tokens`: they were registered when their slots were handed out, and the step that
        was to compute them failed, so nobody may hit them. Call before freeing the sequence."""
        seq = self._seqs.get(seq_id)
        if seq is None or seq.swapped:
            return
        keep = num_tokens // self.block_size
        for blk in seq.blocks[keep:]:
            if blk.ref_cnt == 1:  # shared blocks were computed by someone else
                self.block_pool.uncache(blk)
        del seq.block_hashes[keep:]
        del seq.chain_keys[keep:]

    def take_block_copies(self) -> list[tuple[int, int]]:
        """Pending copy-on-write copies (src, dst), handed over once."""
        copies, self._pending_copies = self._pending_copies, []
        return copies

    # -- swap -----------------------------------------------------------------------------------
    def _distinct_blocks(self, seqs: list[_Seq]) -> int:
        return len({blk.block_id for seq in seqs for blk in seq.blocks})

    def can_swap_out(self, seq_ids: Sequence[int]) -> bool:
        seqs = self._group(seq_ids, swapped=False)
        return self._distinct_blocks(seqs) <= self.cpu_pool.num_free_blocks

    def swap_out(self, seq_ids: Sequence[int]) -> list[tuple[int, int]]:
        """Move a group to CPU blocks; returns (gpu_block, cpu_block) copies. A block shared
        inside the group is copied once and stays shared; its GPU copy stays prefix-cached."""
        seqs = self._group(seq_ids, swapped=False)
        cpu = self.cpu_pool
        needed = self._distinct_blocks(seqs)
        if needed > cpu.num_free_blocks:
            raise OutOfKVBlocks(
                f"swap out {list(seq_ids)}: need {needed} free CPU blocks, "
                f"have {cpu.num_free_blocks} of {cpu.num_blocks}"
            )
        placed: dict[int, KVBlock] = {}
        copies: list[tuple[int, int]] = []
        for seq in seqs:
            cpu_blocks = []
            for blk in seq.blocks:
                dst = placed.get(blk.block_id)
                if dst is None:
                    dst = placed[blk.block_id] = cpu.get_new_block()
                    cpu.set_filled(dst, blk.num_filled)
                    dst.token_ids = blk.token_ids
                    copies.append((blk.block_id, dst.block_id))
                else:
                    cpu.touch(dst)
                cpu_blocks.append(dst)
            self.block_pool.free(reversed(seq.blocks))
            seq.blocks, seq.swapped = cpu_blocks, True
        return copies

    def _swap_in_plan(self, seqs: list[_Seq]) -> tuple[dict[int, KVBlock | None], int]:
        """For each distinct CPU block: the still-cached GPU block with the very same contents
        (reused without a copy), or None. Also the number of free GPU blocks it takes."""
        reuse: dict[int, KVBlock | None] = {}
        for seq in seqs:
            for i, cpu_blk in enumerate(seq.blocks):
                if cpu_blk.block_id not in reuse:
                    reuse[cpu_blk.block_id] = (
                        self.block_pool.get_block_by_key(seq.block_hashes[i], seq.chain_keys[i])
                        if i < len(seq.block_hashes)
                        else None
                    )
        copied = sum(target is None for target in reuse.values())
        revived = {t.block_id for t in reuse.values() if t is not None and t.ref_cnt == 0}
        return reuse, copied + len(revived)

    def can_swap_in(self, seq_ids: Sequence[int]) -> bool:
        _, needed = self._swap_in_plan(self._group(seq_ids, swapped=True))
        return needed <= self.block_pool.num_free_blocks

    def swap_in(self, seq_ids: Sequence[int]) -> list[tuple[int, int]]:
        """Bring a swapped group back; returns (cpu_block, gpu_block) copies."""
        seqs = self._group(seq_ids, swapped=True)
        pool = self.block_pool
        reuse, needed = self._swap_in_plan(seqs)
        if needed > pool.num_free_blocks:
            raise self._out_of_blocks(needed, f"swap in {list(seq_ids)}")
        for target in reuse.values():  # one reference per CPU block, taken before any eviction
            if target is not None:
                pool.touch(target)
        placed: dict[int, tuple[KVBlock, int | None]] = {}
        copies: list[tuple[int, int]] = []
        for seq in seqs:
            gpu_blocks: list[KVBlock] = []
            for i, cpu_blk in enumerate(seq.blocks):
                full = i < len(seq.block_hashes)
                if cpu_blk.block_id in placed:
                    gpu, key = placed[cpu_blk.block_id]
                    pool.touch(gpu)
                elif (target := reuse[cpu_blk.block_id]) is not None:
                    gpu, key = target, seq.chain_keys[i]
                else:
                    gpu, key = pool.get_new_block(), None
                    pool.set_filled(gpu, cpu_blk.num_filled)
                    copies.append((cpu_blk.block_id, gpu.block_id))
                    if full and cpu_blk.token_ids is not None:
                        parent_key = seq.chain_keys[i - 1] if i else 0
                        key = self._record_full_block(
                            gpu, seq.block_hashes[i], cpu_blk.token_ids, parent_key, seq.extra_key
                        )
                placed[cpu_blk.block_id] = (gpu, key)
                if full:
                    seq.chain_keys[i] = key
                gpu_blocks.append(gpu)
            self.cpu_pool.free(reversed(seq.blocks))
            seq.blocks, seq.swapped = gpu_blocks, False
        return copies

    # -- queries --------------------------------------------------------------------------------
    def block_table(self, seq_id: int) -> list[int]:
        return [blk.block_id for blk in self._on_gpu(seq_id).blocks]

    def num_computed_tokens(self, seq_id: int) -> int:
        return self._get(seq_id).num_computed

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
        for seq_id, seq in self._seqs.items():
            assert len(seq.blocks) == _cdiv(seq.num_computed, bs), (
                f"seq {seq_id}: {len(seq.blocks)} blocks for {seq.num_computed} tokens "
                f"(paging reserves nothing ahead)"
            )
            assert len({id(b) for b in seq.blocks}) == len(seq.blocks), (
                f"seq {seq_id}: a block appears twice in one block table"
            )
            n_full = seq.num_computed // bs if self.enable_prefix_caching else 0
            assert len(seq.block_hashes) == len(seq.chain_keys) == n_full, (
                f"seq {seq_id}: {len(seq.block_hashes)} block hashes for {n_full} full blocks"
            )
            for i, blk in enumerate(seq.blocks):
                refs[seq.swapped][blk.block_id] += 1
                expect = min(bs, seq.num_computed - i * bs)
                assert blk.num_filled == expect, (
                    f"seq {seq_id} block {blk.block_id}: {blk.num_filled} slots filled, "
                    f"expected {expect}"
                )
                if blk.block_hash is not None and not seq.swapped:
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
        seq = self._get(seq_id)
        if seq.swapped:
            raise ValueError(f"sequence {seq_id} is swapped out; swap it in first")
        return seq

    def _group(self, seq_ids: Sequence[int], *, swapped: bool) -> list[_Seq]:
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError(f"duplicate sequence ids in {list(seq_ids)}")
        seqs = [self._get(s) for s in seq_ids]
        for seq_id, seq in zip(seq_ids, seqs, strict=True):
            if seq.swapped != swapped:
                state = "already swapped out" if seq.swapped else "not swapped out"
                raise ValueError(f"sequence {seq_id} is {state}")
        return seqs

    def _out_of_blocks(self, needed: int, what: str) -> OutOfKVBlocks:
        return OutOfKVBlocks(
            f"{what}: need {needed} free KV blocks, have {self.block_pool.num_free_blocks} "
            f"of {self.num_blocks} (block_size={self.block_size})"
        )
