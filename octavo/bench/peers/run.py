"""Run a peer's script under the peer's interpreter and read its JSON back."""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path

from octavo.bench.workloads import Workload

HERE = Path(__file__).parent


def run_vllm_offline(python: str, *, model_dir: str, dtype: str, workloads: list[Workload],
                     repeats: int, max_model_len: int, kv_cache_gib: float, threads: int,
                     timeout_s: float = 1800) -> dict:
    """`threads` OpenMP threads, unbound (vLLM's auto binding would pin to cores that other
    users of a shared machine are busy on)."""
    spec = {
        "model": model_dir, "dtype": dtype, "repeats": repeats, "max_model_len": max_model_len,
        "kv_cache_gib": kv_cache_gib,
        "workloads": {wl.name: [[list(r.prompt_token_ids), r.output_len] for r in wl.requests]
                      for wl in workloads},
    }
    with tempfile.TemporaryDirectory() as tmp:
        src, dst = Path(tmp) / "in.json", Path(tmp) / "out.json"
        src.write_text(json.dumps(spec))
        env = {**os.environ, "OMP_NUM_THREADS": str(threads),
               "VLLM_CPU_OMP_THREADS_BIND": "nobind", "HF_HUB_OFFLINE": "1"}
        proc = subprocess.run([python, str(HERE / "vllm_offline.py"), str(src), str(dst)],
                              capture_output=True, text=True, timeout=timeout_s, cwd=tmp,
                              env=env)
        if proc.returncode != 0 or not dst.exists():
            tail = (proc.stderr or proc.stdout)[-2000:]
            raise RuntimeError(f"vllm peer failed (exit {proc.returncode}):\n{tail}")
        return json.loads(dst.read_text())
