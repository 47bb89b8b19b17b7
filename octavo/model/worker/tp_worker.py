"""One tensor-parallel rank: a ModelRunner over its slice of the model, in a process of its own
(mp.py) or a Ray actor (ray.py). The transport calls these methods; every rank runs every plan,
so the collectives inside the forward pass line up, and rank 0 alone samples.
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import octavo.envs as envs
from octavo.config import ModelConfig
from octavo.engine_args import EngineArgs
from octavo.gc_heap import freeze_gc_heap
from octavo.malloc_heap import keep_freed_memory
from octavo.model.parallel.shm_comm import ShmComm, shm_usable
from octavo.model.parallel.tensor_parallel import TPGroup
from octavo.model.worker.cache_sizing import KVBlockCounts
from octavo.model.worker.device import bind_device, rank_device
from octavo.model.worker.runner import ModelRunner
from octavo.step_plan import GrammarBitmask, RunnerOutput, StepPlan

logger = logging.getLogger(__name__)

# how long a rank waits in one collective for the others (a rank that died is noticed sooner:
# its connections close)
COLLECTIVE_TIMEOUT_S = 300
ERROR_GRACE_S = 10  # how long the other ranks get to report after one rank failed a call


def threads_per_rank(size: int) -> int:
    """Each rank's share of this machine's cores (OCTAVO_THREADS_PER_RANK, where set, wins)."""
    return envs.threads_per_rank() or max(1, (os.cpu_count() or 1) // size)


class ResolvedBitmask:
    """A grammar bitmask sent whole (stands in for the engine's Future)."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def result(self) -> Any:
        return self.value


def strip_bitmask(plan: StepPlan, pending: Any = None) -> StepPlan:
    """The plan as it travels to the workers: the bitmask's Future replaced by `pending`."""
    gb = plan.grammar_bitmask
    if gb is None:
        return plan
    return replace(plan, grammar_bitmask=GrammarBitmask(gb.seq_ids, pending, gb.positions))


def accepted_drafts(plan: StepPlan, out: RunnerOutput) -> dict[int, list[int]]:
    """The drafts rank 0 kept this step, by sequence: the other ranks' runners append them to
    their sequences' tokens before the next plan, as rank 0's sampler did to its own."""
    kept: dict[int, list[int]] = {}
    for chunk in plan.chunks:
        if chunk.draft_token_ids and chunk.seq_id in out.sampled_token_ids:
            n = len(out.sampled_token_ids[chunk.seq_id]) - 1
            if n > 0:
                kept[chunk.seq_id] = chunk.draft_token_ids[:n]
    return kept


class Worker:
    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size = rank, size
        self.runner: ModelRunner | None = None
        self.steps = 0  # plans executed

    def init(self, args: EngineArgs, model_dir: Path, config: ModelConfig,
             init_method: str) -> None:
        threads = threads_per_rank(self.size)
        torch.set_num_threads(threads)
        backend = "nccl" if args.device.startswith("cuda") else "gloo"
        # this rank's GPU is current before NCCL or the runner touches the device (device.py)
        device = bind_device(self.device_of_rank(args.device))
        args = replace(args, device=str(device))
        dist.init_process_group(backend, init_method=init_method, rank=self.rank,
                                world_size=self.size,
                                timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
        shm = self._shared_memory(args, config) if backend == "gloo" else None
        tp = TPGroup(self.rank, self.size, dist.group.WORLD, shm=shm)
        self.runner = ModelRunner(args, model_dir, config, tp)
        logger.info("tensor-parallel rank %d/%d ready (pid %d, %d threads, %s)", self.rank,
                    self.size, os.getpid(), threads, "shared memory" if shm else backend)

    def device_of_rank(self, device: str) -> str:
        """This rank's device, from the engine's: the ranks of an `mp` group share this
        machine's GPUs, one each, counted from the engine's device (device.py)."""
        return rank_device(device, self.rank)

    def _shared_memory(self, args: EngineArgs, config: ModelConfig) -> ShmComm | None:
        """Shared-memory collectives when every rank is on this machine (x86), else None.
        A slot holds a step's hidden states in fp32 (capped: larger ones go through gloo)."""
        if not shm_usable():
            return None
        hosts: list[Any] = [None] * self.size
        dist.all_gather_object(hosts, socket.gethostname())
        if len(set(hosts)) != 1:
            return None
        path = [ShmComm.new_path() if self.rank == 0 else None]
        dist.broadcast_object_list(path, src=0)
        slot = min(max(args.max_num_batched_tokens * config.hidden_size * 4, 4 << 20), 64 << 20)
        comm = None
        if self.rank == 0:
            comm = ShmComm(path[0], 0, self.size, slot, True, COLLECTIVE_TIMEOUT_S)
        dist.barrier()
        if self.rank != 0:
            comm = ShmComm(path[0], self.rank, self.size, slot, False, COLLECTIVE_TIMEOUT_S)
        dist.barrier()
        if self.rank == 0:
            os.unlink(path[0])  # every rank has it mapped; nothing is left behind
        return comm

    def size_kv_blocks(self) -> KVBlockCounts:
        assert self.runner is not None
        return self.runner.size_kv_blocks()

    def init_kv_cache(self, num_blocks: int, num_host_blocks: int) -> int:
        """Returns the bytes of one block in this rank's KV cache (its shard of a KV tier
        record: engine/executor/tier_shards.py)."""
        assert self.runner is not None
        self.runner.init_kv_cache(num_blocks, num_host_blocks)
        # start-up is over: a full collection in one rank would stall the whole group
        freeze_gc_heap()
        keep_freed_memory()  # steps' tensors reuse freed pages (malloc_heap.py)
        assert self.runner.kv_cache is not None
        return self.runner.kv_cache.block_nbytes

    def kv_block_format(self) -> str:
        assert self.runner is not None and self.runner.kv_cache is not None
        return self.runner.kv_cache.block_format()

    def kernel_path(self) -> dict[str, Any]:
        assert self.runner is not None
        tp = self.runner.tp
        collectives = "shared memory" if tp is not None and tp.shm is not None else \
            dist.get_backend()
        return {**self.runner.kernel_path(), "tensor_parallel_size": self.size,
                "threads_per_rank": torch.get_num_threads(), "collectives": collectives}

    def execute(self, plan: StepPlan, accepted: dict[int, list[int]]) -> RunnerOutput | None:
        """Rank 0: the step's output; the others compute their part of the forward only, and
        return their copies of the plan's KV tier saves (None where it has none)."""
        runner = self.runner
        assert runner is not None
        self.steps += 1
        if self.rank == 0:
            return runner.execute(plan)
        for seq_id, tokens in accepted.items():
            state = runner.batch.seqs.get(seq_id)
            if state is not None:
                state.token_ids.extend(tokens)
        saved = runner.forward(plan).saved_blocks
        return RunnerOutput(saved_blocks=saved) if saved else None

    def collective_stats(self, reset: bool = False) -> dict[str, Any]:
        """This rank's collectives so far (tensor_parallel.CollectiveStats) and its steps."""
        assert self.runner is not None and self.runner.tp is not None
        stats = self.runner.tp.stats
        out = {"rank": self.rank, "calls": stats.calls, "seconds": stats.seconds,
               "bytes": stats.bytes, "steps": self.steps}
        if reset:
            stats.calls, stats.seconds, stats.bytes, self.steps = 0, 0.0, 0, 0
        return out

    def pid(self) -> int:
        return os.getpid()

    def close(self) -> None:
        tp = self.runner.tp if self.runner is not None else None
        if tp is not None and tp.shm is not None:
            tp.shm.close()
        if dist.is_initialized():
            dist.destroy_process_group()
