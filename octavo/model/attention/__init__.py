"""Attention backends behind one interface (see base.py)."""

from __future__ import annotations

import os

import torch

from octavo.model.attention.base import AttentionBackend
from octavo.model.attention.torch_backend import TorchAttentionBackend

BACKENDS = ("auto", "torch", "cpu")


def get_backend(name: str | None, device: torch.device) -> AttentionBackend:
    """`auto` picks the compiled CPU kernel on CPU when it builds, else plain torch.

    The environment variable OCTAVO_ATTENTION_BACKEND overrides `auto`.
    """
    name = name or "auto"
    if name == "auto":
        name = os.environ.get("OCTAVO_ATTENTION_BACKEND", "auto")
    if name not in BACKENDS:
        raise ValueError(f"attention backend {name!r} is not one of {BACKENDS}")
    if name == "torch" or (name == "auto" and device.type != "cpu"):
        return TorchAttentionBackend()
    if device.type != "cpu":
        raise ValueError("the 'cpu' attention backend runs on CPU only")
    from octavo.model.attention.cpu_backend import CpuPagedAttentionBackend
    from octavo.model.cpu_ops import load_cpu_ops

    kernel = load_cpu_ops()
    if kernel is None:
        if name == "cpu":
            raise RuntimeError("the 'cpu' attention backend could not be built on this machine")
        return TorchAttentionBackend()
    return CpuPagedAttentionBackend(kernel)
