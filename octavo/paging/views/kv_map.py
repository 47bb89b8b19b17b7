"""The page map: every physical KV block's state, for people (the /dashboard) and scripts.

One character per block keeps a snapshot of 10k blocks small and cheap to build and send:

- paged pool (device): `f` free, `u` used by one sequence, `s` shared (ref count > 1), `c`
  cached: free, but holding a full block the prefix cache can still hit (evicted LRU first);
- host (swap) pool: `w` holds a swapped-out sequence's block, `f` free;
- contiguous layout (the baseline, see contiguous.py): `u` reserved and holding tokens, `r`
  reserved for tokens still to come, `x` free but in a gap too small for another reservation
  (external fragmentation), `f` free.

The ref counts of shared blocks and the filled slots of partly filled ones come beside the
states, so a viewer can show the count on a shared block and the internal waste of a partly
filled one. With a KV tier, so do the blocks on their way to it (`tier_saving`: let go of,
waiting for the next step to copy them out) and those the last step loaded from it
(`tier_loaded`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from octavo.paging.block_pool import BlockPool, KVBlock
from octavo.paging.kv_manager import KVCacheManager

PAGED_STATES = {"f": "free", "u": "used", "s": "shared", "c": "cached"}
HOST_STATES = {"f": "free", "w": "swapped"}
CONTIGUOUS_STATES = {"u": "used", "r": "reserved", "x": "external", "f": "free"}

# the host pool's bytes: any reference means a swapped-out block
_HOST = bytes.maketrans(b"usc", b"wwf")


def pool_map(pool: BlockPool, *, host: bool = False,
             partial: Iterable[KVBlock] = ()) -> dict[str, Any]:
    """States of every block of `pool` (one character each, from the state bytes the pool
    keeps), with the ref count of each shared block and the filled slots of each block of
    `partial` (the tails of the sequences: the only blocks in use that can be partly filled) as
    flat [block id, value, ...] lists; few blocks are either, so the snapshot stays small and
    costs O(shared + partial) Python work, not O(blocks)."""
    raw = bytes(pool.states)
    states = (raw.translate(_HOST) if host else raw).decode("ascii")
    shared: list[int] = []
    if not host:
        blocks = pool.blocks
        i = states.find("s")
        while i >= 0:
            shared += (i, blocks[i].ref_cnt)
            i = states.find("s", i + 1)
    filled = {b.block_id: b.num_filled for b in partial}
    return {
        "num_blocks": pool.num_blocks,
        "states": states,
        "shared_ref_cnt": shared,
        "partial_filled": [x for item in sorted(filled.items()) for x in item],
    }


def block_state(pool: BlockPool, block_id: int, *, host: bool = False) -> str:
    """The state name of one block of `pool`."""
    code = bytes(pool.states[block_id:block_id + 1])
    letter = (code.translate(_HOST) if host else code).decode("ascii")
    return (HOST_STATES if host else PAGED_STATES)[letter]


def manager_maps(kv: KVCacheManager) -> tuple[dict[str, Any], dict[str, Any]]:
    """The device and host pool maps of a paged KV cache."""
    device_tails: list[KVBlock] = []
    host_tails: list[KVBlock] = []
    bs = kv.block_size
    for swapped, blk in kv.tail_blocks():
        if blk.num_filled < bs:
            (host_tails if swapped else device_tails).append(blk)
    device = pool_map(kv.block_pool, partial=device_tails)
    device["legend"] = dict(PAGED_STATES)
    if kv.tier is not None:
        device["tier_saving"] = sorted(kv.tier.saving_block_ids())
        device["tier_loaded"] = sorted(kv.tier.last_loaded)
    host = pool_map(kv.cpu_pool, host=True, partial=host_tails)
    host["legend"] = dict(HOST_STATES)
    return device, host


def count_states(states: str, alphabet: dict[str, str]) -> dict[str, int]:
    """How many blocks are in each state, by the state's name."""
    return {name: states.count(ch) for ch, name in alphabet.items()}
