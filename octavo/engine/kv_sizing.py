"""Sizing the KV cache and choosing its allocator from the engine config.

The number of blocks comes from `num_kv_blocks`, or `kv_cache_memory_bytes`, or a default
(1 GiB on CPU, `gpu_memory_utilization` of free memory on CUDA); `max_model_len` defaults to
what fits, and an explicit one that does not fit is an error rather than a later hang.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from octavo.config import CacheConfig, EngineConfig, ModelConfig
from octavo.model.kv_cache import KVCache
from octavo.paging.contiguous import ContiguousAllocator
from octavo.paging.kv_manager import KVCacheManager

DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30  # 1 GiB: ~23k tokens of SmolLM2-135M in fp32


@dataclass(slots=True)
class KVSizing:
    num_blocks: int
    num_host_blocks: int
    max_model_len: int


def size_kv_cache(
    config: EngineConfig, model: ModelConfig, dtype: torch.dtype, device: torch.device
) -> KVSizing:
    cache = config.cache
    block_bytes = KVCache.bytes_per_block(model, cache.block_size, dtype)
    if cache.num_kv_blocks is not None:
        num_blocks = cache.num_kv_blocks
    else:
        budget = cache.kv_cache_memory_bytes
        if budget is None:
            if device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(device)
                budget = int(free * config.gpu_memory_utilization)
            else:
                budget = DEFAULT_CPU_KV_CACHE_BYTES
        num_blocks = budget // block_bytes
        if num_blocks < 1:
            raise ValueError(
                f"kv_cache_memory_bytes={budget} is smaller than one KV block "
                f"({block_bytes} bytes at block_size={cache.block_size})"
            )
    capacity = num_blocks * cache.block_size
    model_limit = model.max_position_embeddings
    if config.max_model_len is None:
        max_model_len = min(model_limit, capacity)
    else:
        max_model_len = config.max_model_len
        if max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {max_model_len}")
        if max_model_len > model_limit:
            raise ValueError(
                f"max_model_len={max_model_len} exceeds the model's max_position_embeddings "
                f"({model_limit})"
            )
        if max_model_len > capacity:
            raise ValueError(
                f"max_model_len={max_model_len} tokens do not fit in the KV cache "
                f"({num_blocks} blocks x {cache.block_size} = {capacity} tokens); "
                "raise kv_cache_memory_bytes / num_kv_blocks or lower max_model_len"
            )
    if config.swap_space is not None:
        num_host = int(config.swap_space * (1 << 30)) // block_bytes
    else:
        num_host = num_blocks if config.preemption_mode == "swap" else 0
    return KVSizing(num_blocks, num_host, max_model_len)


def make_kv_manager(cache: CacheConfig, sizing: KVSizing, reserve: str = "max_model_len"):
    if cache.kv_allocator == "contiguous":
        return ContiguousAllocator(
            sizing.num_blocks, cache.block_size, max_model_len=sizing.max_model_len,
            reserve=reserve,
        )
    return KVCacheManager(
        sizing.num_blocks, cache.block_size,
        enable_prefix_caching=cache.enable_prefix_caching,
        num_cpu_blocks=sizing.num_host_blocks,
    )
