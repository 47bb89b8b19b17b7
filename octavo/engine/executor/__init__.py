"""Executors: run each step's plan on one rank in-process, or on tensor-parallel workers."""

from __future__ import annotations

from pathlib import Path

from octavo.config import ModelConfig
from octavo.engine.executor.base import Executor, UniExecutor, WorkerDiedError
from octavo.engine_args import EngineArgs
from octavo.model.parallel.tensor_parallel import check_tp_config

__all__ = ["Executor", "UniExecutor", "WorkerDiedError", "make_executor"]


def make_executor(args: EngineArgs, model_dir: Path, config: ModelConfig) -> Executor:
    backend = args.executor_backend
    check_tp_config(config, args.tensor_parallel_size)
    if backend == "uni":
        from octavo.model.worker.runner import ModelRunner

        return UniExecutor(ModelRunner(args, model_dir, config))
    if backend == "mp":
        from octavo.engine.executor.mp import MultiprocExecutor

        return MultiprocExecutor(args, model_dir, config)
    from octavo.engine.executor.ray import RayExecutor

    return RayExecutor(args, model_dir, config)
