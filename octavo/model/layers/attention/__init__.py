"""Attention backends behind one interface (see base.py)."""

from __future__ import annotations

import torch

from octavo.model.kernels.cpu_ops import resolve_kernels, select_cpu_ops
from octavo.model.layers.attention.base import AttentionBackend
from octavo.model.layers.attention.cpu_backend import CpuPagedAttentionBackend
from octavo.model.layers.attention.torch_backend import TorchAttentionBackend


def get_backend(name: str | None, device: torch.device,
                isa: str | None = None) -> AttentionBackend:
    """`auto` picks the compiled CPU kernel on CPU when it builds, the Triton kernels on CUDA
    when Triton is installed, else plain torch; `isa` chooses the CPU build (cpu_isa.py; auto:
    the CPU's best). `triton` on CPU runs the Triton kernels in Triton's interpreter (tests).
    """
    if resolve_kernels("attention_backend", name, device) == "triton":
        from octavo.model.layers.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend()
    ops = select_cpu_ops("attention_backend", name, device, isa)
    if ops is None:
        return TorchAttentionBackend()
    return CpuPagedAttentionBackend(ops)
