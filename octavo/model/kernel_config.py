"""Every kernel choice of an engine, resolved once at start-up into a frozen record.

The engine options (`cpu_isa`, `dtype`, `attention_backend`, `fused_ops`, `linear_backend`,
`packed_gemv_rows`, `decode_stack`, `enforce_eager`) may say `auto`; the runner resolves them
here, against the device and this CPU, before anything is built, and hands the resolved values
down, so no layer decides `auto` for itself and no environment variable changes a choice.
`kernel_path()` and the benchmarks report the record.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from octavo.config import ModelConfig
from octavo.engine_args import EngineArgs
from octavo.model.dtype_policy import DtypeChoice, resolve_isa_and_dtype
from octavo.model.kernels.cpu_ops import load_cpu_ops, resolve_kernels
from octavo.model.layers.linear import onednn_usable


@dataclass(frozen=True, slots=True)
class KernelConfig:
    device: str
    isa: str | None  # the compiled CPU ops' instruction set (None off the CPU)
    dtype: str  # what the model computes in
    attention: str  # cpu (octavo's compiled paged attention), torch or triton
    fused_ops: str  # cpu, torch or triton
    linear: str  # onednn (packed weights) or torch
    packed_gemv_rows: int | None  # None: packed_gemv's own limit; 0: never
    decode_stack: bool  # all-decode steps may run their layers in one C++ loop
    cuda_graphs: bool  # decode steps may replay CUDA graphs

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def _compiled_or_torch(kind: str, isa: str | None) -> str:
    """auto's "cpu" stays cpu only where the compiled ops build here."""
    if kind == "cpu" and load_cpu_ops(isa) is None:
        return "torch"
    return kind


def resolve_kernel_config(args: EngineArgs, config: ModelConfig, device: torch.device,
                          tp_size: int = 1) -> tuple[KernelConfig, DtypeChoice]:
    isa, dtype = resolve_isa_and_dtype(args.cpu_isa, args.dtype, config, device)
    attention = resolve_kernels("attention_backend", args.attention_backend, device)
    fused = resolve_kernels("fused_ops", args.fused_ops, device)
    if args.attention_backend == "auto":
        attention = _compiled_or_torch(attention, isa)
    if args.fused_ops == "auto":
        fused = _compiled_or_torch(fused, isa)
    linear = args.linear_backend
    if linear == "auto":
        linear = "onednn" if device.type == "cpu" and onednn_usable(dtype.dtype) else "torch"
    graphs = (device.type == "cuda" and not args.enforce_eager and attention == "triton"
              and tp_size == 1)
    record = KernelConfig(
        device=str(device), isa=isa, dtype=dtype.name, attention=attention, fused_ops=fused,
        linear=linear, packed_gemv_rows=args.packed_gemv_rows,
        decode_stack=args.decode_stack and device.type == "cpu" and tp_size == 1,
        cuda_graphs=graphs)
    return record, dtype
