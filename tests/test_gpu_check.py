"""scripts/gpu_check.sh rehearsed on CPU: `--dry-run` prints every step with its command and
time limit and checks that what the steps import is here, or in the wheel folder, naming what
is missing (the collection of the CUDA tests it also does is left out here: it imports them
all, which the suite's own run of those files covers)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def dry_run(tmp_path: Path, python: str, wheels: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": python, "OCTAVO_WHEELS": str(wheels),
           "OCTAVO_GPU_CHECK_COLLECT": "0"}
    return subprocess.run(["bash", "scripts/gpu_check.sh", "--dry-run", str(tmp_path / "out")],
                          cwd=ROOT, env=env, text=True, capture_output=True, timeout=120)


def test_the_dry_run_lists_every_step_and_finds_what_they_need(tmp_path) -> None:
    done = dry_run(tmp_path, sys.executable, tmp_path / "no-wheels")
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    for step in ("model (limit 90 s", "tests (limit 220 s", "bench (limit 130 s"):
        assert step in out
    assert "OCTAVO_TEST_DEVICE=cuda" in out and "tests/gpu" in out
    assert "octavo.cli bench gpu --quick" in out
    for package in ("triton", "transformers", "pytest", "matplotlib"):
        assert f"  {package}: " in out
    assert "everything the check needs is here" in out
    assert not (tmp_path / "out" / "summary.md").exists()  # nothing ran


def test_the_dry_run_names_what_is_missing_and_the_wheels_that_would_fill_in(tmp_path) -> None:
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / "tqdm-4.67.1-py3-none-any.whl").touch()
    done = dry_run(tmp_path, f"{sys.executable} -S", wheels)  # -S: no site-packages
    assert done.returncode == 1
    assert "torch: missing (a CUDA build is needed" in done.stdout
    assert f"tqdm: missing, installs from {wheels}/tqdm-4.67.1-py3-none-any.whl" in done.stdout
    assert "pytest: missing, and no wheel for it" in done.stdout
    missing = done.stderr.strip().splitlines()[-1]
    assert missing.startswith("gpu_check: missing: torch triton") and "tqdm" not in missing
