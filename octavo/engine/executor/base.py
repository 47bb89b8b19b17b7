"""Executors: who runs the model for the engine. The engine schedules in one place and hands
each step's plan to its executor, which runs it on one or several workers (vLLM's split):

- `UniExecutor`: one ModelRunner in this process (tensor_parallel_size 1);
- `MultiprocExecutor` (mp.py): one worker process per tensor-parallel rank on this machine;
- `RayExecutor` (ray.py): the ranks as Ray actors, on any machines of a Ray cluster.

Every executor answers the same calls, in the order the engine makes them: `size_kv_blocks`
(the fewest blocks any rank fits), `init_kv_cache`, then `execute(plan)` once per step, which
returns rank 0's RunnerOutput; under tensor parallelism its `saved_blocks` are every rank's
shards of the KV tier's blocks joined, and each rank is sent its own slice of the blocks the
plan loads from the tier (tier_shards.py). A worker that dies makes the executor dead for
good: the call raises WorkerDiedError naming the worker, and so does every later call; `dead`
says why.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from dataclasses import replace
from typing import Any

from octavo.engine.executor.tier_shards import TierShards
from octavo.model.worker.cache_sizing import KVBlockCounts
from octavo.model.worker.runner import ModelRunner
from octavo.step_plan import RunnerOutput, StepPlan

logger = logging.getLogger(__name__)


class WorkerDiedError(RuntimeError):
    """A worker of the executor died or its group broke; nothing more runs on it."""


class RankError(RuntimeError):
    """Every rank raised this in the same call (the message is the lowest rank's); the group
    is still in step, so only this call failed."""


def settle_errors(errors: dict[int, str], size: int) -> None:
    """After a call to every rank: raise RankError when all ranks failed it, WorkerDiedError
    when only some did (their collectives no longer line up), nothing when none did."""
    if not errors:
        return
    rank, text = min(errors.items())
    if len(errors) == size:
        raise RankError(text)
    raise WorkerDiedError(f"tensor-parallel worker rank {rank} failed alone, so the group is "
                          f"out of step: {text}")


class Executor(ABC):
    runner: ModelRunner | None = None  # the model in this process, where there is one
    dead: str | None = None  # why the executor can no longer run steps

    @abstractmethod
    def size_kv_blocks(self) -> KVBlockCounts: ...

    @abstractmethod
    def init_kv_cache(self, num_blocks: int, num_host_blocks: int) -> None: ...

    @abstractmethod
    def execute(self, plan: StepPlan) -> RunnerOutput: ...

    @abstractmethod
    def kernel_path(self) -> dict[str, Any]: ...

    @property
    def drafter(self) -> Any:
        """The runner's drafter (speculative decoding by a model), if it runs in-process."""
        return None if self.runner is None else self.runner.drafter

    @abstractmethod
    def kv_block_formats(self) -> list[str]:
        """What the bytes of one KV block are (dtype and shape) in each rank's KV cache, rank
        order: part of the KV tier's fingerprint."""

    def worker_pids(self) -> list[int]:
        """The workers' processes, in rank order (none: the model runs in this process)."""
        return []

    def collective_stats(self, reset: bool = False) -> list[dict[str, Any]]:
        """Per rank: its collectives' calls, seconds and bytes, and the steps it ran (none
        without tensor parallelism); `reset` zeroes them after reading."""
        return []

    def shutdown(self) -> None:  # noqa: B027 (nothing to stop in-process)
        """Stop the workers (idempotent)."""


class UniExecutor(Executor):
    """The whole model in this process."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner

    def size_kv_blocks(self) -> KVBlockCounts:
        assert self.runner is not None
        return self.runner.size_kv_blocks()

    def init_kv_cache(self, num_blocks: int, num_host_blocks: int) -> None:
        assert self.runner is not None
        self.runner.init_kv_cache(num_blocks, num_host_blocks)

    def execute(self, plan: StepPlan) -> RunnerOutput:
        assert self.runner is not None
        return self.runner.execute(plan)

    def kernel_path(self) -> dict[str, Any]:
        assert self.runner is not None
        return self.runner.kernel_path()

    def kv_block_formats(self) -> list[str]:
        assert self.runner is not None and self.runner.kv_cache is not None
        return [self.runner.kv_cache.block_format()]


class RankedExecutor(Executor):
    """An executor of tensor-parallel workers: every call goes to every rank (`_call_all`,
    the transport's), and a worker that dies makes it dead for good (`_fail`)."""

    name = "ranks"
    size: int
    tier_shards: TierShards | None = None  # each rank's bytes of one block (init_kv_cache)

    @abstractmethod
    def _call_all(self, method: str, *args: Any) -> list[Any]:
        """Call `method(*args)` of every rank's Worker; their results in rank order."""

    def _fail(self, why: str) -> None:
        self.dead = why
        logger.error("%s executor: %s; stopping the other workers", self.name, why)
        self.shutdown()
        raise WorkerDiedError(why)

    def size_kv_blocks(self) -> KVBlockCounts:
        counts: list[KVBlockCounts] = self._call_all("size_kv_blocks")
        return min(counts, key=lambda c: c.num_blocks)

    def init_kv_cache(self, num_blocks: int, num_host_blocks: int) -> None:
        sizes = self._call_all("init_kv_cache", num_blocks, num_host_blocks)
        self.tier_shards = TierShards(tuple(sizes))

    def kv_block_formats(self) -> list[str]:
        return self._call_all("kv_block_format")

    def _rank_plans(self, plan: StepPlan) -> list[StepPlan] | None:
        """The plan as each rank gets it where it loads blocks from the KV tier: with only
        that rank's slice of each record (None: every rank gets the same plan)."""
        if not plan.tier_loads:
            return None
        assert self.tier_shards is not None, "init_kv_cache first"
        return [replace(plan, tier_loads=loads)
                for loads in self.tier_shards.split(plan.tier_loads)]

    def _step_output(self, plan: StepPlan, outs: list[RunnerOutput | None]) -> RunnerOutput:
        """Rank 0's output, with every rank's shards of the plan's tier_saves joined."""
        out = outs[0]
        assert out is not None
        if plan.tier_saves:
            assert self.tier_shards is not None
            out.saved_blocks = self.tier_shards.join(
                [o.saved_blocks if o is not None else [] for o in outs], len(plan.tier_saves))
        return out

    def kernel_path(self) -> dict[str, Any]:
        return {**self._call_all("kernel_path")[0], "executor": self.name}

    def collective_stats(self, reset: bool = False) -> list[dict[str, Any]]:
        return self._call_all("collective_stats", reset)
