"""`dtype="auto"` and what a 16-bit dtype becomes on a CPU that does not compute it natively.

- **auto** (the default, as in vLLM): a checkpoint saved in bf16/fp16 runs in bf16 where the CPU
  has native bf16 dot products (avx512_bf16 or AMX, cpu_isa.py) and in the checkpoint's own
  16-bit dtype on CUDA; everywhere else, and for every fp32 checkpoint, fp32. An fp32 checkpoint
  stays fp32 (unlike vLLM, which halves it): octavo's greedy tokens equal HF transformers' fp32
  ones by default.
- **bfloat16 / float16 asked for on a CPU without native bf16** (AVX2 machines): torch and oneDNN
  have no fast 16-bit matmul there (the issue that led here measured bf16 seven times slower
  than fp32), so the model computes in fp32 instead, with one warning saying so. The run then
  costs what fp32 costs, never the cliff; weights and KV cache take fp32's memory.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from octavo.config import ModelConfig
from octavo.model.kernels.cpu_isa import native_bf16, select_isa

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
HALF = ("bfloat16", "float16")
_warned: set[str] = set()


@dataclass(frozen=True, slots=True)
class DtypeChoice:
    requested: str  # as the user spelled it (auto included)
    dtype: torch.dtype  # what the weights, activations and KV cache use
    reason: str

    @property
    def name(self) -> str:
        return str(self.dtype).removeprefix("torch.")


def resolve_dtype(requested: str, config: ModelConfig, device: torch.device,
                  isa: str) -> DtypeChoice:
    """The compute dtype for `requested` (auto, float32, bfloat16, float16) on `device`, with
    `isa` the CPU kernels' instruction set (cpu_isa.select_isa)."""
    if requested != "auto" and requested not in DTYPES:
        raise ValueError(f"dtype={requested!r} is not one of auto, {', '.join(DTYPES)}")
    saved = config.checkpoint_dtype
    if device.type != "cpu":
        if requested == "auto":
            name = saved if saved in HALF else "float32"
            return DtypeChoice(requested, DTYPES[name], f"auto: the checkpoint's {saved}")
        return DtypeChoice(requested, DTYPES[requested], "as asked")
    native = native_bf16(isa)
    if requested == "auto":
        if saved in HALF and native:
            return DtypeChoice(requested, torch.bfloat16,
                               f"auto: a {saved} checkpoint on a CPU with native bf16")
        why = (f"auto: a {saved} checkpoint" if saved not in HALF
               else f"auto: a {saved} checkpoint, but no native bf16 on this CPU (path {isa})")
        return DtypeChoice(requested, torch.float32, why)
    if requested in HALF and not native:
        reason = (f"{requested} asked for, but this CPU has no native bf16 (path {isa}: no "
                  "avx512_bf16 or AMX); computing in float32, which is faster here")
        if requested not in _warned:
            _warned.add(requested)
            logger.warning("dtype=%s: %s", requested, reason)
        return DtypeChoice(requested, torch.float32, reason)
    return DtypeChoice(requested, DTYPES[requested], "as asked")


def resolve_isa_and_dtype(cpu_isa: str | None, dtype: str, config: ModelConfig,
                          device: torch.device) -> tuple[str | None, DtypeChoice]:
    """The engine options `cpu_isa` and `dtype` resolved together, as an engine starts: the
    ISA of the CPU kernels (None off the CPU) and the dtype computed in."""
    isa = select_isa(cpu_isa) if device.type == "cpu" else None
    return isa, resolve_dtype(dtype, config, device, isa or "none")
