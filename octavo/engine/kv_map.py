"""One consistent snapshot of the KV page map and the requests holding it (GET /v1/kv_map).

Built on the engine thread between two steps, so the block states, the block tables and
`stats()` all describe the same moment. The layout is documented with the endpoint in
ARCHITECTURE.md; the block-state letters are paging/kv_map.py's.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from octavo.engine.request import Request
from octavo.paging.contiguous import ContiguousAllocator
from octavo.paging.contiguous_shadow import ContiguousShadow
from octavo.paging.kv_manager import KVCacheManager
from octavo.paging.kv_map import (
    CONTIGUOUS_STATES,
    HOST_STATES,
    count_states,
    manager_maps,
)
from octavo.paging.kv_seq import KVSeq

if TYPE_CHECKING:
    from octavo.engine.engine import LLMEngine

# the waiting queue can be long and holds no blocks: list only its head
MAX_WAITING_LISTED = 64
SHADOW_RESERVES = ("request", "max_model_len")


class KVMapper:
    """Snapshots of one engine's page map; keeps the contiguous shadows between snapshots."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        kv = engine.kv
        self.shadows: list[ContiguousShadow] = []
        if isinstance(kv, KVCacheManager) and kv.num_groups == 1:
            self.shadows = [ContiguousShadow(kv.num_blocks, kv.block_size,
                                             max_model_len=engine.max_model_len, reserve=r)
                            for r in SHADOW_RESERVES]

    def snapshot(self, contiguous: str | None = "request") -> dict[str, Any]:
        """`contiguous`: which shadow layout to include ("request", "max_model_len" or None);
        both shadows follow the traffic at every snapshot either way."""
        if contiguous is not None and contiguous not in SHADOW_RESERVES:
            raise ValueError(f"contiguous must be one of {SHADOW_RESERVES} or None, got "
                             f"{contiguous!r}")
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
            states = kv.layout()
            snap.update(allocator="contiguous", kv_cache_groups=1, prefix_caching=False,
                        device={"num_blocks": kv.num_blocks, "states": states,
                                "legend": CONTIGUOUS_STATES},
                        host={"num_blocks": 0, "states": "", "legend": HOST_STATES})
        for pool in (snap["device"], snap["host"]):
            pool["counts"] = count_states(pool["states"], pool["legend"])
        queues = (("running", sch.running), ("swapped", sch.swapped),
                  ("waiting", sch.waiting[:MAX_WAITING_LISTED]))
        live: list[tuple[KVSeq, int]] = []  # what the contiguous shadows replay
        requests = []
        for status, queue in queues:
            for r in queue:
                requests.append(self._request(r, status, live if status == "running" else None))
        snap["requests"] = requests
        snap["num_requests"] = {"running": len(sch.running), "swapped": len(sch.swapped),
                                "waiting": len(sch.waiting)}
        if self.shadows:
            for shadow in self.shadows:
                shadow.sync(live)
            snap["contiguous"] = next((s.snapshot() for s in self.shadows
                                       if s.reserve == contiguous), None)
        snap["stats"] = eng.stats()
        return snap

    def _request(self, r: Request, status: str,
                 live: list[tuple[KVSeq, int]] | None) -> dict[str, Any]:
        """One request's entry; its sequences on the device join `live` when given."""
        kv = self.engine.kv
        paged = isinstance(kv, KVCacheManager)
        reserve = self.engine.scheduler.reserve_tokens(r)
        seqs = []
        for seq in r.live_seqs:
            if paged:
                held = kv.held_tables(seq.seq_id)
            else:
                held = (False, kv.block_tables(seq.seq_id)) if seq.num_computed_tokens else None
            if live is not None and held is not None and not held[0]:
                live.append((seq, reserve))
            seqs.append({
                "seq_id": seq.seq_id,
                "index": seq.index,
                "output_tokens": seq.num_output_tokens,
                "computed_tokens": seq.num_computed_tokens,
                "swapped": held is not None and held[0],
                "block_tables": held[1] if held is not None else [],
            })
        return {
            "request_id": r.request_id,
            "status": status,
            "priority": r.priority,
            "prompt_tokens": r.num_prompt_tokens,
            "cached_tokens": r.num_cached_tokens or 0,
            "num_preemptions": r.num_preemptions,
            "n": r.max_seqs,
            "seqs": seqs,
        }
