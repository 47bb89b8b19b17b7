"""The `ray` executor: the tensor-parallel ranks as Ray actors, placed by a placement group,
so they can sit on different machines of a Ray cluster (README: "Two machines with Ray").

`ray.init` joins the cluster RAY_ADDRESS names (as `ray start` prints it), or starts a local
one when it is unset. One bundle per rank, each with the rank's share of a machine's CPUs (or one
GPU on CUDA); the actors meet in one torch.distributed group (gloo, NCCL on CUDA) at rank 0's
node address. Every machine needs octavo and the model at the same path as this one.

A call goes to every actor; an actor that dies (its process or its node) makes the executor
dead, naming the rank, its node and its pid. Unlike `mp`, a plan's grammar bitmask is computed
before the plan is sent (Ray passes arguments whole), so structured outputs do not overlap the
forward pass here.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

import octavo.envs as envs
from octavo.config import ModelConfig
from octavo.engine.executor.base import RankedExecutor, WorkerDiedError, settle_errors
from octavo.engine_args import EngineArgs
from octavo.model.worker.tp_worker import (
    ERROR_GRACE_S,
    ResolvedBitmask,
    Worker,
    accepted_drafts,
    strip_bitmask,
    threads_per_rank,
)
from octavo.step_plan import RunnerOutput, StepPlan

logger = logging.getLogger(__name__)

PLACEMENT_TIMEOUT_S = 120


class RayWorker(Worker):
    """A Worker that can say where it is (the actor's class)."""

    def device_of_rank(self, device: str) -> str:
        """Ray shows each actor only the GPU it was given: cuda:0 (model/worker/device.py)."""
        return "cuda:0" if device.startswith("cuda") else device

    def where(self) -> tuple[str, int]:
        """This actor's node address, as the cluster reaches it, and its pid."""
        import ray

        node_id = ray.get_runtime_context().get_node_id()
        ip = next((n["NodeManagerAddress"] for n in ray.nodes() if n["NodeID"] == node_id),
                  None) or ray.util.get_node_ip_address()
        return ip, os.getpid()

    def rendezvous(self) -> str:
        """An address on this node for the group's TCP store (called on rank 0)."""
        from octavo.engine.executor.mp import free_port

        ip = self.where()[0]
        return f"tcp://{ip}:{free_port(ip)}"


class RayExecutor(RankedExecutor):
    name = "ray"

    def __init__(self, args: EngineArgs, model_dir: Path, config: ModelConfig) -> None:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.size = args.tensor_parallel_size
        self._accepted: dict[int, list[int]] = {}
        self._started_ray = not ray.is_initialized()
        if self._started_ray:
            ray.init(address=envs.ray_address(), include_dashboard=False, log_to_driver=True,
                     configure_logging=False)
        cuda = args.device.startswith("cuda")
        bundle = {"GPU": 1.0} if cuda else {"CPU": float(threads_per_rank(self.size))}
        self._pg = placement_group([dict(bundle) for _ in range(self.size)], strategy="PACK")
        self.actors: list[Any] = []
        self._where: list[tuple[str, int]] = []
        try:
            ready, _ = ray.wait([self._pg.ready()], timeout=PLACEMENT_TIMEOUT_S)
            if not ready:
                raise WorkerDiedError(
                    f"the Ray cluster cannot place {self.size} workers of {bundle} each within "
                    f"{PLACEMENT_TIMEOUT_S} s (cluster resources: {ray.cluster_resources()})")
            actor_cls = ray.remote(RayWorker)
            for rank in range(self.size):
                strategy = PlacementGroupSchedulingStrategy(
                    placement_group=self._pg, placement_group_bundle_index=rank)
                self.actors.append(actor_cls.options(
                    num_cpus=0 if cuda else bundle["CPU"], num_gpus=1 if cuda else 0,
                    scheduling_strategy=strategy).remote(rank, self.size))
            self._where = self._call_all("where")
            init_method = ray.get(self.actors[0].rendezvous.remote())
            self._call_all("init", args, model_dir, config, init_method)
        except BaseException:
            self.shutdown()
            raise
        logger.info("ray executor: %d tensor-parallel workers at %s", self.size, self._where)

    def _name(self, rank: int) -> str:
        if rank < len(self._where):
            ip, pid = self._where[rank]
            return f"tensor-parallel worker rank {rank} (node {ip}, pid {pid})"
        return f"tensor-parallel worker rank {rank}"

    def _call_all(self, method: str, *args: Any) -> list[Any]:
        return self._call_each(method, [args] * len(self.actors))

    def _call_each(self, method: str, rank_args: list[tuple[Any, ...]]) -> list[Any]:
        """Call `method(*rank_args[rank])` of every rank's actor; their results in rank order."""
        import ray
        from ray.exceptions import RayActorError, RayTaskError

        if self.dead is not None:
            raise WorkerDiedError(self.dead)
        refs = {getattr(a, method).remote(*args): r
                for r, (a, args) in enumerate(zip(self.actors, rank_args, strict=True))}
        results: dict[int, Any] = {}
        errors: dict[int, str] = {}
        pending = list(refs)
        first_error: float | None = None
        while pending:
            timeout = None if first_error is None else max(
                0.0, first_error + ERROR_GRACE_S - time.monotonic())
            ready, pending = ray.wait(pending, num_returns=1, timeout=timeout)
            if not ready:  # the others are stuck in a collective the failed ones never joined
                break
            rank = refs[ready[0]]
            try:
                results[rank] = ray.get(ready[0])
            except RayActorError as e:
                self._fail(f"{self._name(rank)} died: {type(e).__name__}")
            except RayTaskError as e:
                cause = e.cause if e.cause is not None else e
                errors[rank] = f"{type(cause).__name__}: {cause}"
                first_error = first_error or time.monotonic()
        try:
            settle_errors(errors, self.size)
        except WorkerDiedError as e:
            self._fail(str(e))
        return [results[r] for r in range(self.size)]

    # ---- the executor's calls ---------------------------------------------------------------
    def execute(self, plan: StepPlan) -> RunnerOutput:
        import ray

        gb = plan.grammar_bitmask
        sent = plan if gb is None else strip_bitmask(plan, ResolvedBitmask(gb.pending.result()))
        rank_plans = self._rank_plans(sent)
        if rank_plans is None:
            plan_ref = ray.put(sent)
            rank_args = [(plan_ref, self._accepted)] * self.size
        else:  # each rank gets its own slice of the KV tier's loads
            rank_args = [(ray.put(p), self._accepted) for p in rank_plans]
        out = self._step_output(plan, self._call_each("execute", rank_args))
        self._accepted = accepted_drafts(plan, out)
        return out

    def worker_pids(self) -> list[int]:
        return [pid for _, pid in self._where]

    def shutdown(self) -> None:
        import ray

        if not ray.is_initialized():
            return
        for actor in self.actors:
            ray.kill(actor)
        self.actors = []
        if getattr(self, "_pg", None) is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self._pg)
            self._pg = None
        if self._started_ray:
            ray.shutdown()
