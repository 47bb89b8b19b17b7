"""From the runner's block count to the engine's limits: max_model_len and the KV allocator.

`max_model_len` defaults to what both the model and the KV cache allow; an explicit one that
the cache cannot hold is an error at start-up rather than a request that never fits. Options a
model cannot run with are refused here too, before the weights load.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from octavo.config import ModelConfig
from octavo.engine_args import EngineArgs
from octavo.paging.allocator import KVAllocator
from octavo.paging.baseline.contiguous import ContiguousAllocator
from octavo.paging.kv_manager import KVCacheManager
from octavo.paging.tier import KVTier

if TYPE_CHECKING:
    from octavo.model.worker.cache_sizing import KVBlockCounts


def check_max_model_len(args: EngineArgs, model: ModelConfig) -> None:
    """What can be checked before the weights load."""
    if model.kv_groups.has_state:
        kinds = f"{model.model_type}'s recurrent layers"
        if args.speculative_config is not None:
            raise ValueError(
                f"speculative decoding does not run with {kinds}: their state cannot be rolled "
                "back to the last accepted draft; leave speculative_config unset")
        if args.kv_allocator != "paged":
            raise ValueError(f"kv_allocator={args.kv_allocator!r} holds no recurrent state; "
                             f"{kinds} need the paged KV cache")
        if args.tensor_parallel_size > 1:
            raise ValueError(f"tensor_parallel_size > 1 does not run {kinds} yet")
        if args.kv_offload_dir is not None or args.kv_offload_url is not None:
            raise ValueError(f"the KV tier (kv_offload_dir, kv_offload_url) holds no state "
                             f"snapshots of {kinds}; leave it unset")
    limit, why = model.max_len
    if args.max_model_len is not None and args.max_model_len > limit:
        raise ValueError(f"max_model_len={args.max_model_len} exceeds what this model allows: "
                         f"{why}")


def resolve_max_model_len(args: EngineArgs, model: ModelConfig, num_blocks: int) -> int:
    check_max_model_len(args, model)
    # every KV cache group gives a computed token a slot (a sliding group frees it later)
    groups = len(model.kv_groups.windows) if args.kv_allocator == "paged" else 1
    capacity = num_blocks // groups * args.block_size
    if args.max_model_len is None:
        return min(model.max_len[0], capacity)
    if args.max_model_len > capacity:
        raise ValueError(
            f"max_model_len={args.max_model_len} tokens do not fit in the KV cache "
            f"({num_blocks} blocks x {args.block_size} tokens over {groups} KV cache group(s) "
            f"= {capacity} tokens); "
            "raise kv_cache_memory_bytes / num_kv_blocks or lower max_model_len"
        )
    return args.max_model_len


def make_kv_manager(args: EngineArgs, counts: KVBlockCounts, max_model_len: int,
                    model: ModelConfig, tier: KVTier | None = None) -> KVAllocator:
    """`counts`: the runner's sizing (model/worker/cache_sizing.py)."""
    num_blocks, num_host_blocks = counts.num_blocks, counts.num_host_blocks
    windows = model.kv_groups.windows
    if args.kv_allocator == "contiguous":
        if len(windows) > 1:
            raise ValueError(
                f"kv_allocator='contiguous' holds one block table per sequence, and "
                f"{model.model_type} keeps {len(windows)} (local and global layers); use the "
                "paged KV cache")
        return ContiguousAllocator(num_blocks, args.block_size, max_model_len=max_model_len,
                                   reserve=args.contiguous_reserve)
    return KVCacheManager(num_blocks, args.block_size,
                          enable_prefix_caching=args.enable_prefix_caching,
                          num_cpu_blocks=num_host_blocks, windows=windows, tier=tier,
                          num_state_slots=counts.num_state_slots,
                          num_cpu_state_slots=counts.num_host_state_slots)
