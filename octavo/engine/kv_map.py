"""One consistent snapshot of the KV page map and the requests holding it (GET /v1/kv_map).

Built on the engine thread between two steps, so the block states, the block tables and
`stats()` all describe the same moment. The layout is documented with the endpoint in
ARCHITECTURE.md; the block-state letters are paging/views/kv_map.py's.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Protocol

from octavo.engine.request import Request
from octavo.engine.scheduler import Scheduler
from octavo.paging.allocator import KVAllocator
from octavo.paging.baseline.contiguous import ContiguousAllocator
from octavo.paging.kv_manager import KVCacheManager
from octavo.paging.views.contiguous_shadow import ContiguousShadow
from octavo.paging.views.kv_map import (
    CONTIGUOUS_STATES,
    HOST_STATES,
    block_state,
    count_states,
    manager_maps,
)


class MappedEngine(Protocol):
    """What a snapshot reads of the engine (LLMEngine)."""

    kv: KVAllocator
    scheduler: Scheduler
    model_dir: Path
    max_model_len: int

    def stats(self) -> dict[str, int | float]: ...

# the waiting queue can be long and holds no blocks: list only its head
MAX_WAITING_LISTED = 64
SHADOW_RESERVES = ("request", "max_model_len")


class KVMapper:
    """Snapshots of one engine's page map; keeps the contiguous shadows between snapshots."""

    def __init__(self, engine: MappedEngine) -> None:
        self.engine = engine
        self.num_snapshots = 0
        self.snapshot_seconds = 0.0  # engine-thread time spent building snapshots
        kv = engine.kv
        self.shadows: list[ContiguousShadow] = []
        if isinstance(kv, KVCacheManager) and kv.num_groups == 1:
            self.shadows = [ContiguousShadow(kv.num_blocks, kv.block_size,
                                             max_model_len=engine.max_model_len, reserve=r)
                            for r in SHADOW_RESERVES]

    def snapshot(self, contiguous: str | None = "request",
                 block_tables: bool = False) -> dict[str, Any]:
        """`contiguous`: which shadow layout to include ("request", "max_model_len" or None);
        both shadows follow the traffic at every snapshot either way. `block_tables`: every
        sequence's block tables too (the bulk of a big snapshot; `request()` gives one
        request's)."""
        if contiguous is not None and contiguous not in SHADOW_RESERVES:
            raise ValueError(f"contiguous must be one of {SHADOW_RESERVES} or None, got "
                             f"{contiguous!r}")
        started = time.perf_counter()
        eng = self.engine
        kv, sch = eng.kv, eng.scheduler
        snap: dict[str, Any] = {
            "time": time.time(),
            "model": eng.model_dir.name,
            "block_size": kv.block_size,
            "max_model_len": eng.max_model_len,
        }
        if isinstance(kv, KVCacheManager):
            device, host = manager_maps(kv)
            snap.update(allocator="paged", kv_cache_groups=kv.num_groups,
                        prefix_caching=kv.enable_prefix_caching, device=device, host=host)
        else:
            assert isinstance(kv, ContiguousAllocator)
            snap.update(allocator="contiguous", kv_cache_groups=1, prefix_caching=False,
                        device={"num_blocks": kv.num_blocks, "states": kv.layout(),
                                "legend": dict(CONTIGUOUS_STATES)},
                        host={"num_blocks": 0, "states": "", "legend": dict(HOST_STATES)})
        for pool in (snap["device"], snap["host"]):
            pool["counts"] = count_states(pool["states"], pool["legend"])
        queues = (("running", sch.running), ("swapped", sch.swapped),
                  ("waiting", sch.waiting[:MAX_WAITING_LISTED]))
        snap["requests"] = [self._request(r, status, block_tables)
                            for status, queue in queues for r in queue]
        snap["num_requests"] = {"running": len(sch.running), "swapped": len(sch.swapped),
                                "waiting": len(sch.waiting)}
        if self.shadows:
            # what a contiguous engine would hold: the sequences on the device now
            live = [(seq, sch.reserve_tokens(r)) for r in sch.running for seq in r.live_seqs
                    if seq.num_computed_tokens]
            for shadow in self.shadows:
                shadow.sync(live)
            snap["contiguous"] = next((s.snapshot() for s in self.shadows
                                       if s.reserve == contiguous), None)
        snap["stats"] = eng.stats()
        self.num_snapshots += 1
        self.snapshot_seconds += time.perf_counter() - started
        # what the page map has cost the engine thread so far, this snapshot included
        snap["cost"] = {"snapshots": self.num_snapshots, "seconds": self.snapshot_seconds}
        return snap

    def request(self, request_id: str) -> dict[str, Any] | None:
        """One live request's entry with its block tables, or None."""
        sch = self.engine.scheduler
        for status, queue in (("running", sch.running), ("swapped", sch.swapped),
                              ("waiting", sch.waiting)):
            for r in queue:
                if r.request_id == request_id:
                    return self._request(r, status, True)
        return None

    def block(self, block_id: int, host: bool = False) -> dict[str, Any]:
        """One block: its state, ref count, filled slots and who holds it (request, sequence,
        group, logical index), from a scan of the live block tables."""
        kv = self.engine.kv
        if not isinstance(kv, KVCacheManager):
            raise ValueError("block details need the paged KV cache")
        pool = kv.cpu_pool if host else kv.block_pool
        if not 0 <= block_id < pool.num_blocks:
            raise ValueError(f"block {block_id} is not in the {'host' if host else 'device'} "
                             f"pool (0..{pool.num_blocks - 1})")
        blk = pool.blocks[block_id]
        holders = []
        sch = self.engine.scheduler
        for r in (*sch.running, *sch.swapped):
            for seq in r.live_seqs:
                held = kv.held_tables(seq.seq_id)
                if held is None or held[0] != host:
                    continue
                for group, table in enumerate(held[1]):
                    holders += [{"request_id": r.request_id, "seq_id": seq.seq_id,
                                 "group": group, "logical": i}
                                for i, b in enumerate(table) if b == block_id]
        return {"block_id": block_id, "pool": "host" if host else "device",
                "state": block_state(pool, block_id, host=host), "ref_cnt": blk.ref_cnt,
                "filled": blk.num_filled, "prefix_cached": blk.block_hash is not None,
                "holders": holders}

    def _request(self, r: Request, status: str, block_tables: bool) -> dict[str, Any]:
        kv = self.engine.kv
        bs = kv.block_size
        swapped = status == "swapped"
        seqs = [{
            "seq_id": q.seq_id,
            "index": q.index,
            "output_tokens": len(q.token_ids) - q.num_prompt_tokens,
            "computed_tokens": q.num_computed_tokens,
            "swapped": swapped,
            "num_blocks": -(-q.num_computed_tokens // bs),  # its table's length (each group's)
        } for q in r.seqs if q.finish_reason is None]
        if block_tables:
            for entry in seqs:
                if isinstance(kv, KVCacheManager):
                    held = kv.held_tables(entry["seq_id"])
                else:
                    held = ((False, kv.block_tables(entry["seq_id"]))
                            if entry["computed_tokens"] else None)
                entry["block_tables"] = held[1] if held is not None else []
        return {
            "request_id": r.request_id,
            "status": status,
            "priority": r.priority,
            "prompt_tokens": len(r.prompt_token_ids),
            "cached_tokens": r.num_cached_tokens or 0,
            "num_preemptions": r.num_preemptions,
            "n": r.max_seqs,
            "seqs": seqs,
        }
