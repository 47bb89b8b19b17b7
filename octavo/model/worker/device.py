"""The device a rank computes on, made the process's current device before anything allocates.

Every CUDA call that names no device uses the current one: Triton's launches, CUDA graphs and
their memory pool, `torch.cuda.Stream()`, NCCL's communicator. A rank whose tensors live on
cuda:1 while cuda:0 is current launches its kernels on the wrong GPU, so `bind_device` calls
`torch.cuda.set_device` first, in the runner and, under tensor parallelism, in the worker
before the process group starts. Which GPU a rank takes:

- one rank (`uni`): `--device cuda:N` is cuda:N; `cuda` is the current device (cuda:0 unless
  the process chose another);
- `mp` (every rank on this machine): rank r of a group whose `--device` is cuda:N takes
  cuda:N + r (`cuda` counts from 0);
- `ray`: Ray gives each actor one GPU and shows it only that one (CUDA_VISIBLE_DEVICES), so
  every actor computes on cuda:0.
"""

from __future__ import annotations

from typing import Any

import torch


def rank_device(device: str, local_index: int) -> str:
    """The device of the rank whose GPU is the `local_index`-th of its group's on this machine
    (`device`: the engine's, which a CPU run keeps)."""
    d = torch.device(device)
    if d.type != "cuda":
        return device
    return f"cuda:{(d.index or 0) + local_index}"


def bind_device(device: str, cuda: Any = None) -> torch.device:
    """`device` as a torch.device with an explicit index, made current where it is a GPU.
    `cuda`: the torch.cuda module (the tests pass a stand-in)."""
    d = torch.device(device)
    if d.type != "cuda":
        return d
    cuda = cuda if cuda is not None else torch.cuda
    if not cuda.is_available():
        raise ValueError(f"device={device!r} was asked for but no CUDA device is available")
    count = cuda.device_count()
    index = d.index if d.index is not None else cuda.current_device()
    if index >= count:
        raise ValueError(f"device={device!r}: this process sees {count} CUDA device(s) "
                         f"(cuda:0..cuda:{count - 1}); CUDA_VISIBLE_DEVICES limits which")
    cuda.set_device(index)
    return torch.device("cuda", index)
