"""paging/ must stay readable and testable without torch or numpy."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

# Import octavo.paging without running octavo/__init__.py (which loads the model stack), then
# check that nothing heavy came along with it.
PROBE = """
import sys, types
pkg = types.ModuleType("octavo")
pkg.__path__ = [{root!r}]
sys.modules["octavo"] = pkg
import octavo.paging, octavo.paging.kv_manager, octavo.paging.waste
import octavo.paging.baseline.contiguous
import octavo.paging.views.kv_map, octavo.paging.views.contiguous_shadow
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "numpy"))
assert not heavy, heavy
"""


def test_paging_imports_neither_torch_nor_numpy() -> None:
    root = str(Path(__file__).resolve().parents[2] / "octavo")
    result = subprocess.run(
        [sys.executable, "-c", PROBE.format(root=root)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
