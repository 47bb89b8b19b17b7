"""Triton's interpreter is chosen by the tensors' device, never by the machine or by an import
(model/kernels/triton/__init__.py): CPU tensors need the interpreter, CUDA tensors the compiler,
and a launch in the other mode says how to start the process instead of failing inside
Triton."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from octavo.model.kernels.triton import COMPILER_NEEDED, INTERPRETER_NEEDED, mode_problem

ROOT = Path(__file__).resolve().parents[3]


def test_the_device_decides_the_mode() -> None:
    assert mode_problem("cpu", interpreter=True) is None
    assert mode_problem("cuda", interpreter=False) is None
    assert mode_problem("cpu", interpreter=False) == INTERPRETER_NEEDED
    assert mode_problem("cuda", interpreter=True) == COMPILER_NEEDED


def test_importing_octavo_leaves_the_mode_alone() -> None:
    """In a process started without TRITON_INTERPRET, importing octavo and its Triton kernels
    sets nothing; Triton compiles, so CPU tensors get the error that names the fix."""
    script = """
import os, torch
import octavo, octavo.model.kernels.triton as kernels
from octavo.model.kernels.triton import decode
assert "TRITON_INTERPRET" not in os.environ, "an import set TRITON_INTERPRET"
assert not kernels.interpreted()
assert kernels.triton_missing("cpu") == kernels.INTERPRETER_NEEDED
q, cache = torch.zeros(1, 1, 16), torch.zeros(1, 16, 1, 16)
try:
    decode.paged_decode(q, cache, cache, torch.zeros(1, 1, dtype=torch.long),
                        torch.ones(1, dtype=torch.long), 1.0)
except RuntimeError as e:
    assert str(e) == kernels.INTERPRETER_NEEDED, e
    print("refused")
"""
    env = {k: v for k, v in os.environ.items()
           if k not in ("TRITON_INTERPRET", "OCTAVO_TEST_DEVICE")}
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, text=True,
                         capture_output=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "refused"
