"""octavo's compiled CPU ops (csrc/), built once per machine on first use.

- `paged_decode`: paged attention for single-token decodes, reading K/V in place.
- `paged_prefill`: paged attention for every prefill chunk of a step in one call.
- `kv_write`: the KV write into int8 / fp8 pages, quantized per token (kv_quant.py); both
  attention kernels read such pages in place (kv_rows.h).
- `rms_norm`, `add_rms_norm_`: RMSNorm, and the residual add fused with the next RMSNorm.
- `rope_`: rotary embedding of q and k, in place in the fused qkv buffer.
- `silu_and_mul`: SwiGLU's silu(gate) * up from the fused gate_up buffer.
- `quantize_rows_int8`, `int8_epilogue`: the two ends of a W8A8 linear layer (quantization.py),
  `int8_gemv`, its exact int32 products for decode-sized batches (`int8_mm` picks it or
  oneDNN's GEMM), and `int8_linear`, the three in one call.
- `block_linear`, `block_dequantize`: linear layers whose weights stay in 4-, 5- or 8-bit
  blocks (GGUF Q4_0/Q4_1/Q5_0/Q8_0, int4; block_quant.py); decode-sized batches on the register
  kernels (block_idot.h on int8 activations), and, on int8 activations, batches of 17 rows or
  more in integer tiles (block_tile.h on AVX512-VNNI, block_tile_avx2.h in the AVX2 build and
  in the AVX-512 build on a CPU without VNNI; `block_int8_tiles` says whether this build has
  them, `block_tiles_path` which run, `block_tiles_set_vnni` is the AVX-512 build's A/B).
- `kquant_linear`, `kquant_dequantize`: the same for GGUF's K-quant super-blocks (Q4_K, Q5_K,
  Q6_K) on integer dot products, the AVX-512 build taking AVX512-VNNI where the CPU has it;
  from 8 rows on in tiles of 8 activation rows (kquant_tile.h), each row's bits unchanged;
  `kquant_repack`, the file's super-blocks into the layout they take (codes in lane order:
  kquant_codes.h).
- `gated_delta_step`, `ssd_step`: one decode step of the recurrent layers (Gated DeltaNet,
  Mamba-2) for a batch, each sequence's state updated in place in its state slot.
- `DecodeStack`: every decoder layer of an all-decode step in one C++ loop (decode_stack.py).

They are built with torch's C++ extension tooling into ``$OCTAVO_CACHE/torch_extensions/<isa>``
(a minute the first time, instant later), once per instruction set (cpu_isa.py): the AVX-512
build carries hand-written AVX-512 decode code, the AVX2 build AVX2+FMA code, and the portable
build only what the compiler vectorises for the baseline ISA; the fused ops are vectorised by the
compiler for each. Which build runs is chosen at run time from the CPU's flags, never from
`-march=native`, so a build cached on one machine never runs on a CPU that lacks its
instructions. Where they cannot be built (no compiler), octavo falls back to plain torch and says
so once.
"""

from __future__ import annotations

import logging
from functools import cache
from pathlib import Path
from typing import Any

import torch

from octavo.envs import cache_dir
from octavo.model.kernels.cpu_isa import ISA_CFLAGS, select_isa

logger = logging.getLogger(__name__)
_CSRC = Path(__file__).parent / "csrc"
SOURCES = ("bindings.cpp", "paged_decode.cpp", "paged_prefill.cpp", "fused_ops.cpp",
           "quant_ops.cpp", "block_linear.cpp", "decode_stack.cpp", "int8_gemv.cpp",
           "packed_gemv.cpp", "kquant_linear.cpp", "kquant_repack.cpp", "recurrent_step.cpp",
           "kv_write.cpp")
CHOICES = ("auto", "torch", "cpu", "triton")


def resolve_kernels(setting: str, choice: str | None, device: torch.device) -> str:
    """Which kernels an engine setting (attention_backend, fused_ops) picks: "torch", "cpu"
    (octavo's compiled CPU ops) or "triton" (model/kernels/triton). auto: the compiled ops on
    CPU, Triton on CUDA where it is installed, else torch."""
    choice = choice or "auto"
    if choice not in CHOICES:
        raise ValueError(f"{setting}={choice!r} is not one of {CHOICES}")
    if choice == "auto" and device.type == "cpu":
        return "cpu"
    if choice == "cpu" and device.type != "cpu":
        raise ValueError(f"{setting}='cpu' runs on CPU only")
    if choice in ("cpu", "torch"):
        return choice
    from octavo.model.kernels.triton import triton_missing  # CPU tensors: the interpreter

    problem = triton_missing(device.type)
    if choice == "auto":
        return "triton" if device.type == "cuda" and problem is None else "torch"
    if problem is not None:
        raise RuntimeError(f"{setting}='triton': {problem}")
    return "triton"


def select_cpu_ops(setting: str, choice: str | None, device: torch.device,
                   isa: str | None = None) -> Any | None:
    """The compiled ops for an engine setting that chooses between them and plain torch, or
    None for torch (or Triton: see resolve_kernels). auto: the compiled ops on CPU when they
    build; cpu: the compiled ops, or an error naming `setting`. `isa`: the cpu_isa setting
    (auto: the CPU's best)."""
    explicit = (choice or "auto") != "auto"
    if resolve_kernels(setting, choice, device) != "cpu":
        return None
    ops = load_cpu_ops(select_isa(isa))
    if ops is None and explicit:
        raise RuntimeError(f"{setting}='cpu': octavo's compiled CPU ops could not be built on "
                           "this machine")
    return ops


@cache
def load_cpu_ops(isa: str | None = None) -> Any | None:
    """The compiled module for `isa` (default: the CPU's best), or None when it cannot be
    built here. Its `isa()` names the path it was compiled for."""
    isa = select_isa(isa)
    try:
        from torch.utils.cpp_extension import load

        root = cache_dir() / "torch_extensions"
        build = root / isa
        build.mkdir(parents=True, exist_ok=True)
        ops = load(
            name=f"octavo_cpu_ops_{isa}",
            sources=[str(_CSRC / s) for s in SOURCES],
            extra_include_paths=[str(_CSRC)],
            extra_cflags=["-O3", "-fopenmp", *ISA_CFLAGS[isa]],
            extra_ldflags=["-fopenmp"],
            build_directory=str(build),
            verbose=False,
        )
    except Exception as e:  # noqa: BLE001 - any build failure means "use plain torch"
        logger.warning("octavo's CPU ops (%s) are unavailable (%s); using plain torch", isa, e)
        return None
    if ops.isa() != isa:  # the build's own macros disagree with the flags it was given
        logger.warning("octavo's CPU ops built for %s report %s; using plain torch", isa,
                       ops.isa())
        return None
    logger.info("octavo's CPU ops: the %s path", isa)
    return ops
