"""Every environment variable octavo reads, read here and nowhere else.

Settings that change what the engine computes are `EngineArgs` options (engine_args.py); the
variables below are the few things that belong to the process rather than to an engine: where
octavo keeps its caches, the API key a server falls back to, and the plumbing between a
tensor-parallel worker process and its parent. Each is read when asked for, so a test that sets
one with monkeypatch sees it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path


def cache_dir() -> Path:
    """`$OCTAVO_CACHE` (default ~/.cache/octavo): converted models, compiled CPU ops."""
    return Path(os.environ.get("OCTAVO_CACHE", Path.home() / ".cache" / "octavo"))


def api_key() -> str | None:
    """`$OCTAVO_API_KEY`: the key `octavo serve` and `octavo router` require when no
    `--api-key` is given."""
    return os.environ.get("OCTAVO_API_KEY") or None


def threads_per_rank() -> int | None:
    """`$OCTAVO_THREADS_PER_RANK`: the threads each tensor-parallel rank on this machine takes
    (default: the machine's cores shared out); set it on each machine of a Ray cluster."""
    value = os.environ.get("OCTAVO_THREADS_PER_RANK", "")
    return int(value) if value.isdigit() and int(value) > 0 else None


def tp_shared_memory() -> bool:
    """`$OCTAVO_TP_SHM` (default 1): tensor-parallel ranks on one machine all-reduce through
    shared memory; 0 makes them use the torch.distributed group."""
    return os.environ.get("OCTAVO_TP_SHM", "1") != "0"


def omp_num_threads() -> int | None:
    """`$OMP_NUM_THREADS`, where set to a positive number."""
    value = os.environ.get("OMP_NUM_THREADS", "")
    return int(value) if value.isdigit() and int(value) > 0 else None


def ray_address() -> str | None:
    """`$RAY_ADDRESS`: the Ray cluster the ray executor joins (None: a local one)."""
    return os.environ.get("RAY_ADDRESS") or None


def log_level() -> str:
    """`$OCTAVO_LOG_LEVEL` (default WARNING): a worker process's logging level."""
    return os.environ.get("OCTAVO_LOG_LEVEL", "WARNING")


def worker_rendezvous() -> tuple[str, int, bytes]:
    """(host, port, authkey) a tensor-parallel worker process connects back to its parent
    with: `$OCTAVO_WORKER_ADDRESS` and `$OCTAVO_WORKER_AUTHKEY`, set by the parent."""
    host, port = os.environ["OCTAVO_WORKER_ADDRESS"].rsplit(":", 1)
    return host, int(port), bytes.fromhex(os.environ["OCTAVO_WORKER_AUTHKEY"])


def child_env(extra: Mapping[str, str]) -> dict[str, str]:
    """This process's environment with `extra` set: what a child process is started with."""
    return {**os.environ, **extra}


def cuda_visible_devices() -> list[str] | None:
    """`$CUDA_VISIBLE_DEVICES` as a list of device ids (None: unset, every GPU is visible)."""
    value = os.environ.get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return None
    return [d.strip() for d in value.split(",") if d.strip()]
