"""Opening the KV tier at start-up: its fingerprint, its store, and the KVTier the KV manager
owns (paging/tier/).

A tier record is only ever loaded into a cache that computes the very same bytes, so records
live under a fingerprint of everything that changes a block's contents beyond its tokens (the
chained block hash, with the request's cache salt, names those): the model (its config and a
sample of every weight file's bytes, so a fine-tune or another revision of the same
architecture does not match), the dtype the KV is computed in and stored as, the block's
layout (block size, KV heads, head size, layer slots of a KV cache group), the groups' windows
and layers, the tensor-parallel size, and the weight quantization. Servers with equal
fingerprints share records, whichever machine they run on.

Under tensor parallelism a record holds every rank's shard of its block, in rank order
(engine/executor/tier_shards.py), so the fingerprint names the group's size and each rank's
block format, not one rank. Another size computes other numbers (the all-reduces add in
another order) and cuts the heads otherwise, so records written at one size are never read at
another, 1 included. One rank keeps the fields it always had ("tensor_parallel": [0, 1], one
block format), so its directories written before stay found.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from octavo.config import ModelConfig
from octavo.engine_args import EngineArgs
from octavo.paging.tier import DiskStore, KVTier, TierStore

logger = logging.getLogger(__name__)

FORMAT = 1  # bump when what a record's bytes mean changes
DEFAULT_TIER_BYTES = 16 << 30
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth")
SAMPLES_PER_FILE = 32
SAMPLE_BYTES = 64 << 10


def model_identity(model_dir: Path) -> str:
    """A digest of the model's config and weights: every config file whole, and of each weight
    file its name, size and SAMPLES_PER_FILE evenly spaced 64 KiB slices (a second or less even
    for a large model; training changes every tensor, so any slice tells two weights apart)."""
    h = hashlib.blake2b(digest_size=16)
    for path in sorted(model_dir.iterdir()):
        if not path.is_file():
            continue
        if path.name in ("config.json", "generation_config.json"):
            h.update(path.name.encode() + b"\0" + path.read_bytes())
        elif path.suffix in WEIGHT_SUFFIXES:
            size = path.stat().st_size
            h.update(f"{path.name}\0{size}\0".encode())
            with open(path, "rb") as f:
                step = max(size // SAMPLES_PER_FILE, 1)
                for offset in range(0, size, step):
                    f.seek(offset)
                    h.update(f.read(SAMPLE_BYTES))
    return h.hexdigest()


def fingerprint(args: EngineArgs, model_dir: Path, config: ModelConfig, dtype: str,
                block_formats: Sequence[str]) -> dict[str, Any]:
    """`block_formats`: each rank's `KVCache.block_format()`, rank order (one: no tensor
    parallelism)."""
    groups = config.kv_groups
    size = len(block_formats)
    if size == 0:
        raise ValueError("the KV tier's fingerprint needs the block format of every rank")
    return {
        "format": FORMAT,
        "model": model_identity(model_dir),
        "model_type": config.model_type,
        "dtype": dtype,
        "kv_block": block_formats[0] if size == 1 else list(block_formats),
        "block_size": args.block_size,
        "kv_groups": {"windows": list(groups.windows), "layer_group": list(groups.layer_group),
                      "layer_slot": list(groups.layer_slot)},
        # one rank: its [rank, size], as always; a group: records of all its ranks' shards
        "tensor_parallel": [0, 1] if size == 1 else {"size": size, "ranks": list(range(size))},
        "quantization": args.quantization,
        "quantization_group_size": args.quantization_group_size if args.quantization else None,
    }


def fingerprint_digest(fp: dict[str, Any]) -> str:
    blob = json.dumps(fp, sort_keys=True).encode()
    return hashlib.blake2b(blob, digest_size=16).hexdigest()


def open_store(args: EngineArgs, fp: dict[str, Any]) -> TierStore:
    digest = fingerprint_digest(fp)
    if args.kv_offload_url is not None:
        from octavo.engine.redis_tier import RedisStore

        return RedisStore(args.kv_offload_url, namespace=digest)
    assert args.kv_offload_dir is not None
    root = Path(args.kv_offload_dir) / digest
    store = DiskStore(root, args.kv_offload_bytes or DEFAULT_TIER_BYTES)
    _describe(root, fp)
    return store


def _describe(root: Path, fp: dict[str, Any]) -> None:
    """fingerprint.json beside the records: what they were computed by (for people)."""
    path = root / "fingerprint.json"
    if path.exists():
        return
    tmp = root / f".fingerprint.{os.getpid()}.tmp"
    try:
        tmp.write_text(json.dumps(fp, indent=1, sort_keys=True) + "\n")
        os.replace(tmp, path)
    except OSError as e:
        logger.warning("KV tier: cannot describe %s: %s", root, e)


def open_tier(args: EngineArgs, fp: dict[str, Any]) -> KVTier | None:
    """The KV tier these options ask for (None: none)."""
    if args.kv_offload_dir is None and args.kv_offload_url is None:
        return None
    store = open_store(args, fp)
    tier = KVTier(store, write=args.kv_offload_write)
    stats = store.stats()
    logger.info("KV tier: %s store, %d blocks (%d bytes) found", store.name,
                stats.get("tier_blocks", 0), stats.get("tier_bytes", 0))
    return tier
