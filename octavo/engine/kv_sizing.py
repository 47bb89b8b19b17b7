"""From the runner's block count to the engine's limits: max_model_len and the KV allocator.

`max_model_len` defaults to what both the model and the KV cache allow; an explicit one that
the cache cannot hold is an error at start-up rather than a request that never fits.
"""

from __future__ import annotations

from octavo.config import ModelConfig
from octavo.engine_args import EngineArgs
from octavo.paging.allocator import KVAllocator
from octavo.paging.baseline.contiguous import ContiguousAllocator
from octavo.paging.kv_manager import KVCacheManager
from octavo.paging.tier import KVTier


def check_max_model_len(args: EngineArgs, model: ModelConfig) -> None:
    """What can be checked before the weights load."""
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


def make_kv_manager(args: EngineArgs, num_blocks: int, num_host_blocks: int,
                    max_model_len: int, model: ModelConfig,
                    tier: KVTier | None = None) -> KVAllocator:
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
                          num_cpu_blocks=num_host_blocks, windows=windows, tier=tier)
