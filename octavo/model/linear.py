"""Linear layers with pre-packed oneDNN weights on CPU.

torch's CPU `F.linear` in fp32 goes to MKL's sgemm, which on non-Intel CPUs runs its AVX2 code
path; oneDNN's matmul with the weight reordered once into its blocked layout runs the CPU's
widest kernels (on the AMD EPYC this project is measured on: 2.2-2.4x MKL's fp32 GFLOP/s at
the model's shapes, and up to 1.6x in bf16 for small decode batches; see BENCHMARKS.md).

`pack_linears(model)` swaps every `nn.Linear` for a `PackedLinear` after the weights are loaded
and cast. Each packed layer is checked against `F.linear` on a random batch first; any failure
(no oneDNN, an unsupported dtype) keeps the plain layer. OCTAVO_LINEAR=torch turns it off.
"""

from __future__ import annotations

import logging
import os

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)

LINEAR_BACKENDS = ("auto", "torch", "onednn")
_CHECK_TOL = {torch.float32: 1e-3, torch.bfloat16: 0.1}


class PackedLinear(nn.Module):
    """y = x W^T + b with W held in oneDNN's packed layout (inference only)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        weight = linear.weight.detach()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight)
        self.bias = None if linear.bias is None else linear.bias.detach()
        self.dtype = weight.dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, onednn"


def onednn_usable(dtype: torch.dtype) -> bool:
    if dtype not in _CHECK_TOL or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return False
    return hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def _checked(linear: nn.Linear) -> PackedLinear | None:
    """The packed layer, if it agrees with F.linear on a random batch."""
    try:
        packed = PackedLinear(linear)
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(3, linear.in_features, generator=gen).to(linear.weight.dtype)
        with torch.inference_mode():
            want = F.linear(x, linear.weight, linear.bias).float()
            got = packed(x).float()
        tol = _CHECK_TOL[linear.weight.dtype] * max(1.0, want.abs().max().item())
        if got.shape != want.shape or (got - want).abs().max().item() > tol:
            return None
        return packed
    except (RuntimeError, AttributeError) as e:  # oneDNN refused this layer
        logger.warning("oneDNN linear unavailable (%s); using F.linear", e)
        return None


def pack_linears(model: nn.Module, backend: str | None = None) -> int:
    """Replace the model's nn.Linear layers by PackedLinear where oneDNN serves them.

    backend: auto (pack on CPU when oneDNN works), torch (never), onednn (required: raise if it
    cannot be used). The environment variable OCTAVO_LINEAR overrides auto. Returns how many
    layers were packed.
    """
    backend = backend or "auto"
    if backend == "auto":
        backend = os.environ.get("OCTAVO_LINEAR", "auto")
    if backend not in LINEAR_BACKENDS:
        raise ValueError(f"linear backend {backend!r} is not one of {LINEAR_BACKENDS}")
    if backend == "torch":
        return 0
    targets = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) is nn.Linear
    ]
    if not targets:
        return 0
    first = targets[0][2].weight
    if first.device.type != "cpu" or not onednn_usable(first.dtype):
        if backend == "onednn":
            raise ValueError(f"the onednn linear backend cannot serve {first.dtype} on "
                             f"{first.device.type}")
        return 0
    count = 0
    for parent, name, child in targets:
        packed = _checked(child)
        if packed is None:
            if backend == "onednn":
                raise RuntimeError(f"oneDNN could not pack linear layer {name!r}")
            continue
        setattr(parent, name, packed)
        count += 1
    return count
