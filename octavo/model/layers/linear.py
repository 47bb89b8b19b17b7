"""Linear layers with pre-packed oneDNN weights on CPU.

torch's CPU `F.linear` in fp32 goes to MKL's sgemm, which on non-Intel CPUs runs its AVX2 code
path; oneDNN's matmul with the weight reordered once into its blocked layout runs the CPU's
widest kernels (on the AMD EPYC this project is measured on: 2.2-2.4x MKL's fp32 GFLOP/s at
the model's shapes, and up to 1.6x in bf16 for small decode batches; see BENCHMARKS.md).

`pack_linears(model)` swaps every `nn.Linear` for a `PackedLinear` after the weights are loaded
and cast. Each packed layer is checked against `F.linear` on a random batch first; any failure
(no oneDNN, an unsupported dtype) keeps the plain layer. linear_backend=torch turns it off.

Decode-sized batches (up to `ops.packed_gemv_max_rows(dtype, block)` rows: with AVX-512 32 in
fp32 and 24 in bf16 (16 on AMX tiles), with AVX2 16 in fp32) skip oneDNN's per-call set-up:
octavo's `packed_gemv` (csrc/packed_gemv.cpp) reads the same packed buffer in place. Its layout
is oneDNN's internal choice, so `gemv_layout` checks it for every shape and dtype by packing
matrices that encode each weight's coordinates and comparing the buffer with the layouts
packed_gemv reads (blocks of 64 outputs; of 32 for bf16 where oneDNN uses AMX); any other
layout (another oneDNN version or CPU) keeps oneDNN for that layer. packed_gemv_rows=0 turns
it off (the benchmarks' A/B), packed_gemv_rows=N gives it steps of at most N rows.
"""

from __future__ import annotations

import ctypes
import logging
from functools import cache
from typing import Any

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

        # packed_gemv for up to gemv_rows rows (use_gemv); 0: oneDNN for every batch
        self.ops: Any = None
        self.gemv_rows = 0
        self.k_padded = 0
        self.gemv_block = GEMV_BLOCKS[0]
        self.weight_ptr = 0

    def use_gemv(self, ops: Any, limit: int | None = None) -> bool:
        """Let `ops.packed_gemv` compute batches of up to its max rows (and `limit`, 0: never)
        where it reads this layer's packed layout (checked, see gemv_layout); returns whether
        it does."""
        self.ops, self.gemv_rows = None, 0
        if limit is not None and limit < 0:
            raise ValueError(f"packed_gemv_rows must be >= 0, got {limit}")
        if (ops is None or not hasattr(ops, "packed_gemv") or limit == 0
                or ops.packed_gemv_max_rows(self.dtype) < 1):
            return False
        layout = gemv_layout(self.out_features, self.in_features, self.dtype)
        if layout is None:
            return False
        self.ops, (self.k_padded, self.gemv_block) = ops, layout
        self.weight_ptr = torch.ops.mkldnn.data_ptr(self.packed)
        self.gemv_rows = min(ops.packed_gemv_max_rows(self.dtype, self.gemv_block),
                             limit or 64)
        gen = torch.Generator().manual_seed(1)
        x = torch.randn(2, self.in_features, generator=gen).to(self.dtype)
        try:
            with torch.inference_mode():
                want = torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none",
                                                          [], "")
                got = self.forward(x)
            tol = _CHECK_TOL[self.dtype] * max(1.0, want.float().abs().max().item())
            agree = (got.float() - want.float()).abs().max().item() <= tol
        except RuntimeError as e:
            logger.warning("packed_gemv failed on a [%d, %d] layer (%s)", self.out_features,
                           self.in_features, e)
            agree = False
        if not agree:
            logger.warning("packed_gemv disagrees with oneDNN on a [%d, %d] layer; using oneDNN",
                           self.out_features, self.in_features)
            self.ops, self.gemv_rows = None, 0
        return self.gemv_rows > 0

    def gemv_args(self) -> tuple[int, int, int, int, int]:
        """(weight pointer, N, Kp, rows, block) for the C++ decode loop's packed_gemv calls."""
        if not self.gemv_rows:
            return (0, 0, 0, 0, GEMV_BLOCKS[0])
        return (self.weight_ptr, self.out_features, self.k_padded, self.gemv_rows,
                self.gemv_block)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if 0 < x.shape[0] <= self.gemv_rows and x.dim() == 2:
            return self.ops.packed_gemv(x, self.weight_ptr, self.out_features, self.k_padded,
                                        self.bias, self.gemv_block)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        gemv = (f", packed_gemv up to {self.gemv_rows} rows (blocks of {self.gemv_block})"
                if self.gemv_rows else "")
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"onednn{gemv}")


# outputs per block of the layouts packed_gemv reads: 64 (oneDNN's AVX2 and AVX-512 kernels),
# 32 (bf16 where oneDNN uses AMX)
GEMV_BLOCKS = (64, 32)


def _packed_view(packed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """oneDNN's packed buffer as a flat tensor of `dtype` (no copy; `packed` must outlive it)."""
    nbytes = torch.ops.mkldnn._nbytes(packed)
    buf = (ctypes.c_byte * nbytes).from_address(torch.ops.mkldnn.data_ptr(packed))
    return torch.frombuffer(buf, dtype=dtype)


def gemv_layout_of(n: int, k: int, k_padded: int, dtype: torch.dtype, plain: torch.Tensor,
                   block: int = GEMV_BLOCKS[0]) -> torch.Tensor:
    """`plain` [n, k] laid out as packed_gemv reads it, in blocks of B = `block` outputs: fp32
    [ceil(n/B)][Kp][B], bf16 [ceil(n/B)][Kp/2][B][2], zeros in the padding."""
    blocks = -(-n // block)
    padded = torch.zeros(blocks * block, k_padded, dtype=plain.dtype)
    padded[:n, :k] = plain
    if dtype == torch.bfloat16:
        return padded.view(blocks, block, k_padded // 2, 2).permute(0, 2, 1, 3).flatten()
    return padded.view(blocks, block, k_padded).permute(0, 2, 1).flatten()


def _digits(size: int, base: int) -> list[torch.Tensor]:
    """0..size-1 written in `base`, one tensor of digits + 1 (1..base) per place."""
    index, out = torch.arange(size, dtype=torch.int32), []
    while True:
        out.append(index % base + 1)
        index = index // base
        if not bool(index.any()):
            return out


@cache
def gemv_layout(n: int, k: int, dtype: torch.dtype) -> tuple[int, int] | None:
    """(Kp, block) where oneDNN packs an [n, k] weight of `dtype` in one of packed_gemv's
    layouts, else None.

    Checked, not assumed: matrices whose entries encode their row (and then their column)
    index, digit by digit in a base the dtype holds exactly (+ 1, so that padding's zeros
    differ), are packed by oneDNN and compared with gemv_layout_of the same matrices, for each
    block width whose size fits the buffer's."""
    if dtype not in (torch.float32, torch.bfloat16):
        return None
    try:
        return _checked_layout(n, k, dtype)
    except (RuntimeError, AttributeError):  # no such oneDNN op, or it refused the shape
        return None


def _checked_layout(n: int, k: int, dtype: torch.dtype) -> tuple[int, int] | None:
    esize = torch.empty((), dtype=dtype).element_size()
    nbytes = torch.ops.mkldnn._nbytes(torch.ops.mkldnn._reorder_linear_weight(
        torch.zeros(n, k, dtype=dtype)))
    candidates = []  # (Kp, block) the buffer's size allows
    for block in GEMV_BLOCKS:
        k_padded, rest = divmod(nbytes, -(-n // block) * block * esize)
        if not rest and k_padded >= k and not (dtype == torch.bfloat16 and k_padded % 2):
            candidates.append((k_padded, block))
    base = 255 if dtype == torch.bfloat16 else 2**23  # 1..base are exact in the dtype
    for axis, size in ((0, n), (1, k)):
        for digits in _digits(size, base):
            if not candidates:
                return None
            vec = digits.to(dtype)
            plain = (vec[:, None] if axis == 0 else vec[None, :]).expand(n, k).contiguous()
            packed = torch.ops.mkldnn._reorder_linear_weight(plain)
            view = _packed_view(packed, dtype)
            candidates = [(kp, block) for kp, block in candidates
                          if torch.equal(view, gemv_layout_of(n, k, kp, dtype, plain, block))]
    return candidates[0] if candidates else None


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
    cannot be used). Returns how many layers were packed.
    """
    backend = backend or "auto"
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
