"""Every environment variable octavo reads, read here and nowhere else.

Settings that change what the engine computes are `EngineArgs` options (engine_args.py); the
variables below are the few things that belong to the process rather than to an engine: where
octavo keeps its caches, the API key a server falls back to, and the plumbing between a
tensor-parallel worker process and its parent. Each is read when asked for, so a test that sets
one with monkeypatch sees it.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """`$OCTAVO_CACHE` (default ~/.cache/octavo): converted models, compiled CPU ops."""
    return Path(os.environ.get("OCTAVO_CACHE", Path.home() / ".cache" / "octavo"))


def cuda_visible_devices() -> list[str] | None:
    """`$CUDA_VISIBLE_DEVICES` as a list of device ids (None: unset, every GPU is visible)."""
    value = os.environ.get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return None
    return [d.strip() for d in value.split(",") if d.strip()]
