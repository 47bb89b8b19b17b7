"""octavo's Triton kernels: the GPU backend (see attention/triton_backend.py).

Triton is one language for NVIDIA and AMD GPUs, and its interpreter runs the very same kernels
on CPU tensors, one program instance at a time with NumPy: that is how the tests check every
kernel against the torch backend on a machine without a GPU. Which of the two a process runs is
Triton's choice, made once, when Triton is imported (``TRITON_INTERPRET=1`` in the environment
then: the interpreter); octavo never flips it, since importing a package must not change the
process. The tensors' device says which one a launch needs: CPU tensors the interpreter, CUDA
tensors the compiler. `triton_missing(device)` says so clearly where the process runs the other
one (the backends ask it when they are built), and every launch checks its tensors
(`check_device`). The test suite chooses the mode from the device its Triton tests use
(tests/conftest.py: ``OCTAVO_TEST_DEVICE``, cpu by default). Only the Triton paths import this
package: a CPU engine on its default kernels never does.

- `decode.py`: paged decode attention, split-K (flash-decoding) with a reduce pass, GQA query
  groups sharing one K/V read;
- `prefill.py`: paged prefill/extend attention, varlen over the step's chunks, causal inside a
  chunk, attending to cached blocks (prefix hits, earlier chunks) through the block tables;
- `cache_ops.py`: the KV write at the slot mapping (vLLM's reshape_and_cache) and block copies
  (copy-on-write);
- `fused_ops.py`: RMSNorm (with the residual add), RoPE in place, SiLU-and-mul.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from typing import Any

import torch

INTERPRETER_NEEDED = (
    "Triton kernels on CPU tensors run only in Triton's interpreter, and this process "
    "imported Triton without it: start the process with TRITON_INTERPRET=1 in its "
    "environment (the tests: OCTAVO_TEST_DEVICE=cpu, the default)")
COMPILER_NEEDED = (
    "Triton kernels on CUDA tensors are compiled for the GPU, and this process imported "
    "Triton in its interpreter (TRITON_INTERPRET=1): start it without that variable (the "
    "tests: OCTAVO_TEST_DEVICE=cuda)")


@cache
def interpreted() -> bool:
    """True when this process runs Triton's interpreter. Triton made its own library functions
    interpreted or compiled when it was imported, and that holds for the whole process, so the
    answer is read from them (not from the environment, which may have changed since)."""
    import triton.language.standard as standard
    from triton.runtime.interpreter import InterpretedFunction

    probe = getattr(standard, "zeros", None) or standard.cdiv  # @jit in every Triton 3
    return isinstance(probe, InterpretedFunction)


def jit(fn: Callable[..., Any]) -> Any:
    """`triton.jit`, in the mode Triton runs in this process (see `interpreted`), whatever the
    environment says by the time octavo's kernel modules are imported."""
    if interpreted():
        from triton.runtime.interpreter import InterpretedFunction

        return InterpretedFunction(fn)
    from triton.runtime.jit import JITFunction

    return JITFunction(fn)


def mode_problem(device_type: str, interpreter: bool) -> str | None:
    """Why tensors on `device_type` cannot go to Triton kernels running in the interpreter
    (`interpreter`) or compiled, or None."""
    if device_type == "cpu" and not interpreter:
        return INTERPRETER_NEEDED
    if device_type == "cuda" and interpreter:
        return COMPILER_NEEDED
    return None


@cache
def triton_missing(device_type: str | None = None) -> str | None:
    """Why the Triton kernels cannot run here (on tensors of `device_type`, where given):
    Triton not installed, or running in the other mode (see the module doc); None if they
    can."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except ImportError as e:
        return f"triton is not installed ({e}); `pip install triton`"
    if device_type is None:
        return None
    return mode_problem(device_type, interpreted())


def check_device(t: torch.Tensor) -> None:
    """Raise a RuntimeError naming the fix where `t`'s device needs the other Triton mode."""
    problem = mode_problem(t.device.type, interpreted())
    if problem is not None:
        raise RuntimeError(problem)
