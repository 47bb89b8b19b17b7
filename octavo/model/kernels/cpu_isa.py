"""Which instruction set octavo's CPU kernels use, chosen at run time from the CPU's flags.

The machines this project runs on change from one day to the next (AVX-512 with native bf16 on
one, AVX2 only on the next), so nothing is decided by how the compiler was invoked: the compiled
ops are built once per ISA (cpu_ops.py), and the best ISA this CPU has is picked here when an
engine starts. `cpu_isa="avx2"` forces a lower path, e.g. to test the
AVX2 kernels on an AVX-512 machine; asking for one the CPU lacks is an error naming the flags.

- `avx512`: AVX-512 F/BW/VL/DQ (+ AVX2, FMA, F16C), 16 fp32 lanes;
- `avx2`: AVX2 + FMA + F16C, 8 fp32 lanes;
- `portable`: the compiler's baseline for the architecture (SSE2 on x86-64), any CPU.

`native_bf16()` says whether the CPU computes bf16 dot products itself (avx512_bf16 or AMX):
`dtype="auto"` picks bf16 only there, and an explicit bf16 elsewhere runs in fp32 (runner.py).
"""

from __future__ import annotations

import platform
from functools import cache

ISAS = ("avx512", "avx2", "portable")  # best first
ISA_CHOICES = ("auto", *ISAS)
ISA_FLAGS: dict[str, tuple[str, ...]] = {
    "avx512": ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx2", "fma", "f16c"),
    "avx2": ("avx2", "fma", "f16c"),
    "portable": (),
}
# what the compiler is told for each build (cpu_ops.py); tuning stays generic so that a build
# cached on one machine is as good on the next one with the same ISA
ISA_CFLAGS: dict[str, tuple[str, ...]] = {
    "avx512": ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma",
               "-mf16c", "-mtune=generic"),
    "avx2": ("-mavx2", "-mfma", "-mf16c", "-mtune=generic"),
    "portable": (),
}
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


@cache
def cpu_flags() -> frozenset[str]:
    """Every flag of /proc/cpuinfo's first CPU (empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def is_x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64", "i686", "i386")


def supported_isas(flags: frozenset[str] | None = None) -> list[str]:
    """The ISAs this CPU runs, best first (always ends with portable)."""
    flags = cpu_flags() if flags is None else flags
    if not is_x86():
        return ["portable"]
    return [isa for isa in ISAS if all(f in flags for f in ISA_FLAGS[isa])]


def select_isa(requested: str | None = None, flags: frozenset[str] | None = None) -> str:
    """The ISA for the CPU kernels: the best the CPU has for auto, else the one asked for,
    which the CPU must have."""
    requested = requested or "auto"
    if requested not in ISA_CHOICES:
        raise ValueError(f"cpu_isa={requested!r} is not one of {ISA_CHOICES}")
    have = supported_isas(flags)
    if requested == "auto":
        return have[0]
    if requested not in have:
        flags = cpu_flags() if flags is None else flags
        missing = [f for f in ISA_FLAGS[requested] if f not in flags] or [platform.machine()]
        raise ValueError(f"cpu_isa={requested!r}: this CPU lacks {', '.join(missing)} "
                         f"(it runs {', '.join(have)})")
    return requested


def native_bf16(isa: str, flags: frozenset[str] | None = None) -> bool:
    """Whether bf16 is computed natively on the path `isa`: the CPU has avx512_bf16 or AMX and
    the path is not forced below AVX-512."""
    flags = cpu_flags() if flags is None else flags
    return isa == "avx512" and any(f in flags for f in NATIVE_BF16_FLAGS)
