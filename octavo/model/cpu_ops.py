"""octavo's compiled CPU ops (csrc/), built once per machine on first use.

- `paged_decode`: paged attention for single-token decodes, reading K/V in place.
- `rms_norm`, `add_rms_norm_`: RMSNorm, and the residual add fused with the next RMSNorm.
- `rope_`: rotary embedding of q and k, in place in the fused qkv buffer.
- `silu_and_mul`: SwiGLU's silu(gate) * up from the fused gate_up buffer.

They are built with torch's C++ extension tooling into ``$OCTAVO_CACHE/torch_extensions`` (a
minute the first time, instant later). Where they cannot be built (no compiler), octavo falls back
to plain torch and says so once.
"""

from __future__ import annotations

import logging
import os
from functools import cache
from pathlib import Path
from typing import Any

import torch

from octavo.model.loader import cache_dir

logger = logging.getLogger(__name__)
_CSRC = Path(__file__).parent / "csrc"
SOURCES = ("bindings.cpp", "paged_decode.cpp", "fused_ops.cpp")
CHOICES = ("auto", "torch", "cpu")


def select_cpu_ops(setting: str, choice: str | None, device: torch.device,
                   env_var: str) -> Any | None:
    """The compiled ops for an engine setting that chooses between them and plain torch, or
    None for torch. auto: the compiled ops on CPU when they build (`env_var` overrides auto);
    torch: never; cpu: the compiled ops, or an error naming `setting`."""
    choice = choice or "auto"
    if choice == "auto":
        choice = os.environ.get(env_var, "auto")
    if choice not in CHOICES:
        raise ValueError(f"{setting}={choice!r} is not one of {CHOICES}")
    if choice == "torch" or (choice == "auto" and device.type != "cpu"):
        return None
    if device.type != "cpu":
        raise ValueError(f"{setting}='cpu' runs on CPU only")
    ops = load_cpu_ops()
    if ops is None and choice == "cpu":
        raise RuntimeError(f"{setting}='cpu': octavo's compiled CPU ops could not be built on "
                           "this machine")
    return ops


@cache
def load_cpu_ops() -> Any | None:
    """The compiled module, or None when it cannot be built here."""
    try:
        from torch.utils.cpp_extension import load

        build = cache_dir() / "torch_extensions"
        build.mkdir(parents=True, exist_ok=True)
        os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(build))
        return load(
            name="octavo_cpu_ops",
            sources=[str(_CSRC / s) for s in SOURCES],
            extra_include_paths=[str(_CSRC)],
            extra_cflags=["-O3", "-march=native", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            build_directory=str(build),
            verbose=False,
        )
    except Exception as e:  # noqa: BLE001 - any build failure means "use plain torch"
        logger.warning("octavo's CPU ops are unavailable (%s); using plain torch", e)
        return None
