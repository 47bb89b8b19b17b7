"""One GPU per rank, current before anything allocates (model/worker/device.py), checked on CPU
through a stand-in for torch.cuda that records every set_device."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from octavo.config import ModelConfig
from octavo.engine_args import EngineArgs
from octavo.model.worker import runner as runner_module
from octavo.model.worker.device import bind_device, rank_device
from tests.conftest import TINY_CONFIG


class Started(Exception):
    """Raised by the stand-ins where the test has seen enough."""


class FakeCuda:
    """torch.cuda's device calls, on a machine of `count` GPUs; `calls` in order."""

    def __init__(self, calls: list[tuple[str, object]], count: int = 4) -> None:
        self.calls, self.count, self.current = calls, count, 0

    def is_available(self) -> bool:
        return True

    def device_count(self) -> int:
        return self.count

    def current_device(self) -> int:
        return self.current

    def set_device(self, index: int) -> None:
        self.calls.append(("set_device", index))
        self.current = index


@pytest.fixture
def calls(monkeypatch) -> list[tuple[str, object]]:
    """torch.cuda replaced by a FakeCuda of 4 GPUs, and dist.init_process_group recorded
    (then stopped: no group is started)."""
    seen: list[tuple[str, object]] = []
    fake = FakeCuda(seen)
    for name in ("is_available", "device_count", "current_device", "set_device"):
        monkeypatch.setattr(torch.cuda, name, getattr(fake, name))

    def init_process_group(backend: str, **kwargs) -> None:
        seen.append(("init_process_group", backend))
        raise Started

    monkeypatch.setattr(dist, "init_process_group", init_process_group)
    return seen


def test_bind_device_makes_the_index_current(calls) -> None:
    assert bind_device("cpu") == torch.device("cpu") and calls == []
    assert bind_device("cuda:2") == torch.device("cuda", 2)
    assert bind_device("cuda") == torch.device("cuda", 2)  # the current one, named
    assert calls == [("set_device", 2), ("set_device", 2)]
    with pytest.raises(ValueError, match="sees 4 CUDA device"):
        bind_device("cuda:4")
    assert rank_device("cuda", 1) == "cuda:1" and rank_device("cuda:2", 1) == "cuda:3"
    assert rank_device("cpu", 1) == "cpu"


@pytest.mark.parametrize("device, want", [("cuda", 1), ("cuda:2", 3)])
def test_mp_rank_binds_its_gpu_before_the_process_group(calls, device, want) -> None:
    from octavo.model.worker.tp_worker import Worker

    with pytest.raises(Started):
        Worker(1, 2).init(EngineArgs(device=device, tensor_parallel_size=2), Path("."),
                          ModelConfig.from_hf_dict({**TINY_CONFIG, "model_type": "llama"}),
                          "tcp://127.0.0.1:1")
    assert calls == [("set_device", want), ("init_process_group", "nccl")]


def test_ray_actor_binds_the_one_gpu_it_sees(calls) -> None:
    from octavo.engine.executor.ray import RayWorker

    with pytest.raises(Started):
        RayWorker(1, 2).init(EngineArgs(device="cuda", tensor_parallel_size=2), Path("."),
                             ModelConfig.from_hf_dict({**TINY_CONFIG, "model_type": "llama"}),
                             "tcp://127.0.0.1:1")
    assert calls == [("set_device", 0), ("init_process_group", "nccl")]


def test_runner_binds_cuda_n_before_loading(calls, monkeypatch) -> None:
    def load_model(*args, **kwargs):
        calls.append(("load_model", str(args[3])))
        raise Started

    monkeypatch.setattr(runner_module, "load_model", load_model)
    config = ModelConfig.from_hf_dict({**TINY_CONFIG, "model_type": "llama"})
    with pytest.raises(Started):
        runner_module.ModelRunner(EngineArgs(device="cuda:1"), Path("."), config)
    assert calls == [("set_device", 1), ("load_model", "cuda:1")]
