"""How many KV blocks the device and the host get, decided by the runner after the weights load.

Device blocks: from `num_kv_blocks`, else `kv_cache_memory_bytes`, else a default: 1 GiB on
CPU; on CUDA what `gpu_memory_utilization` of the device's total memory leaves once the weights
(and anything else already on the device, other processes included) are counted, read from the
driver after loading, and once two things the cache does not exist yet to share with are set
aside (vLLM's rule: the utilization caps everything the engine uses, not just the cache): the
activation peak of the largest step, and the memory pool the decode CUDA graphs keep, both
measured before the cache exists (profile_run.py).

Host blocks (swap): their own size, `swap_space` GiB as in vLLM (default 4 GiB with
preemption_mode=swap, never more blocks than the device has, since a swapped-out request held
device blocks first; none otherwise), not a mirror of the device pool: on a GPU that would pin
as much host memory as the GPU's whole KV cache.

A model with recurrent layers also needs state slots (paging/state_slots.py): one per running
sequence (`max_num_seqs`) and as many again for prefix-cache snapshots when prefix caching is
on, or `num_state_slots`. They come out of the same memory, at most half of it; where half
holds fewer, fewer sequences run at once (a sequence without a slot waits like one without
blocks). With `num_kv_blocks` the blocks are as asked and the slots come on top; with host blocks
there are as many host slots, on top of them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from octavo.config import ModelConfig
from octavo.engine_args import EngineArgs
from octavo.model.layers.kv_cache import KVCache
from octavo.model.layers.kv_quant import KVFormat

logger = logging.getLogger(__name__)

DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30  # 1 GiB: ~23k tokens of SmolLM2-135M in fp32
DEFAULT_SWAP_SPACE_GIB = 4.0  # vLLM's swap_space

MemInfo = Callable[[torch.device], tuple[int, int]]  # (free, total) bytes, like cuda.mem_get_info


@dataclass(frozen=True, slots=True)
class KVBlockCounts:
    num_blocks: int
    num_host_blocks: int
    block_bytes: int
    num_state_slots: int = 0  # recurrent layers' state slots (0: none)
    num_host_state_slots: int = 0
    state_slot_bytes: int = 0


def cuda_kv_budget(device: torch.device, utilization: float,
                   mem_get_info: MemInfo | None = None, activation_bytes: int = 0,
                   graph_pool_bytes: int = 0) -> int:
    """Bytes the KV cache may take: utilization x total, minus what is in use already (the
    weights, anyone else's memory), the profiled activation peak and the CUDA graphs' pool."""
    free, total = (mem_get_info or torch.cuda.mem_get_info)(device)
    in_use = total - free
    budget = int(total * utilization) - in_use - activation_bytes - graph_pool_bytes
    logger.info("KV cache sizing on %s: %.2f GiB total, %.2f GiB in use after loading, "
                "%.2f GiB activation peak (profile run), %.2f GiB CUDA graph pool, "
                "utilization %.2f -> %.2f GiB for the KV cache", device, total / 2**30,
                in_use / 2**30, activation_bytes / 2**30, graph_pool_bytes / 2**30,
                utilization, budget / 2**30)
    if budget <= 0:
        raise ValueError(
            f"gpu_memory_utilization={utilization} leaves no memory for the KV cache: "
            f"{in_use / 2**30:.2f} of {total / 2**30:.2f} GiB are in use after loading the "
            f"weights, the largest step's activations need {activation_bytes / 2**30:.2f} GiB "
            f"and the CUDA graphs' pool {graph_pool_bytes / 2**30:.2f} GiB")
    return budget


def state_slot_count(args: EngineArgs) -> int:
    """State slots asked for: `num_state_slots`, else one per running sequence, twice that with
    prefix caching (the other half holds snapshots)."""
    if args.num_state_slots is not None:
        return args.num_state_slots
    return args.max_num_seqs * (2 if args.enable_prefix_caching else 1)


def size_kv_blocks(args: EngineArgs, config: ModelConfig, dtype: torch.dtype,
                   device: torch.device, mem_get_info: MemInfo | None = None,
                   extra_block_bytes: int = 0,
                   activation_peak: Callable[[], int] | None = None,
                   graph_pool: Callable[[], int] | None = None,
                   state_slot_bytes: int = 0, fmt: KVFormat | None = None) -> KVBlockCounts:
    """`extra_block_bytes`: what each block costs beyond the target's K/V (a draft model's
    cache, which has the same blocks); `activation_peak` and `graph_pool` (None: no graphs):
    the profile runs, called only where the budget comes from gpu_memory_utilization;
    `state_slot_bytes`: one state slot of the recurrent layers (0: a model without them);
    `fmt`: how K/V are stored (kv_cache_dtype: the bytes of a token in that format, an int8
    row's scale included; None: the model dtype)."""
    block_bytes = KVCache.bytes_per_block(config, args.block_size, dtype, fmt) + extra_block_bytes
    slots = state_slot_count(args) if state_slot_bytes else 0
    if args.num_kv_blocks is not None:
        num_blocks = args.num_kv_blocks
    else:
        budget = args.kv_cache_memory_bytes
        if budget is None:
            if device.type == "cuda":
                peak = activation_peak() if activation_peak is not None else 0
                pool = graph_pool() if graph_pool is not None else 0
                budget = cuda_kv_budget(device, args.gpu_memory_utilization, mem_get_info,
                                        peak, pool)
            else:
                budget = DEFAULT_CPU_KV_CACHE_BYTES
        if slots:
            slots = max(1, min(slots, budget // 2 // state_slot_bytes))
            budget -= slots * state_slot_bytes
        num_blocks = budget // block_bytes
        if num_blocks < 1:
            raise ValueError(
                f"kv_cache_memory_bytes={budget} is smaller than one KV block "
                f"({block_bytes} bytes at block_size={args.block_size})"
            )
    num_host = host_blocks(args, num_blocks, block_bytes)
    host_slots = slots if num_host else 0
    if slots:
        logger.info("recurrent state: %d slots of %.1f MiB (%d on the host)", slots,
                    state_slot_bytes / 2**20, host_slots)
    return KVBlockCounts(num_blocks, num_host, block_bytes, slots, host_slots, state_slot_bytes)


def host_blocks(args: EngineArgs, num_blocks: int, block_bytes: int) -> int:
    """Host (swap) blocks: `swap_space` GiB where given; with preemption_mode=swap
    DEFAULT_SWAP_SPACE_GIB, at most as many blocks as the device has; else none."""
    if args.swap_space is not None:
        return int(args.swap_space * (1 << 30)) // block_bytes
    if args.preemption_mode != "swap":
        return 0
    return min(num_blocks, int(DEFAULT_SWAP_SPACE_GIB * (1 << 30)) // block_bytes)
