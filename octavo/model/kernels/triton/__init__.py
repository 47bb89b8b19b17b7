"""octavo's Triton kernels: the GPU backend (see attention/triton_backend.py).

Triton is one language for NVIDIA and AMD GPUs, and its interpreter (``TRITON_INTERPRET=1``)
runs the very same kernels on CPU tensors, one program instance at a time with NumPy. That is
how the test suite checks every kernel against the torch reference on a machine without a GPU:
on such a machine importing this package turns the interpreter on, before any kernel module
imports Triton (a process that set ``TRITON_INTERPRET`` itself keeps its choice; one that
imported Triton earlier gets a clear error, see `triton_missing`; the tests' conftest sets the
variable first). Only the Triton paths import this package: a CPU engine on its default
kernels never does.

- `decode.py`: paged decode attention, split-K (flash-decoding) with a reduce pass, GQA query
  groups sharing one K/V read;
- `prefill.py`: paged prefill/extend attention, varlen over the step's chunks, causal inside a
  chunk, attending to cached blocks (prefix hits, earlier chunks) through the block tables;
- `cache_ops.py`: the KV write at the slot mapping (vLLM's reshape_and_cache) and block copies
  (copy-on-write);
- `fused_ops.py`: RMSNorm (with the residual add), RoPE in place, SiLU-and-mul.
"""

from __future__ import annotations

import os
import sys
from functools import cache

import torch

# Triton decides at import whether its own library functions are interpreted: it must not have
# been imported yet (torch._dynamo imports it, and transformers imports torch._dynamo)
_TOO_LATE = False
if not torch.cuda.is_available() and "TRITON_INTERPRET" not in os.environ:
    _TOO_LATE = "triton" in sys.modules
    os.environ["TRITON_INTERPRET"] = "1"


@cache
def triton_missing() -> str | None:
    """Why the Triton kernels cannot run here (Triton not installed, or imported without its
    interpreter on a machine without a GPU), or None."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except ImportError as e:
        return f"triton is not installed ({e}); `pip install triton`"
    if _TOO_LATE:
        return ("there is no GPU here and Triton was imported (by torch or transformers) before "
                "octavo could turn its interpreter on: set TRITON_INTERPRET=1 in the "
                "environment")
    return None


def interpreted() -> bool:
    """True when the kernels run in Triton's interpreter (CPU tensors, for the tests)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
