"""`octavo models`: the models octavo installs by name (catalog.py) and the GGUF files it has
opened before, each with its family, size, format and the quantization it runs with by default.
Only headers are read: nothing is assembled, hashed or converted."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

from octavo.envs import cache_dir
from octavo.model import catalog
from octavo.model.quant.gguf_file import GGUFFile, GGUFFormatError
from octavo.model.quant.gguf_tensors import ARCHITECTURES
from octavo.model.quant.gguf_weights import block_types


def describe_gguf(path: Path, quantization: str | None) -> dict[str, str]:
    """Family, size and format of a GGUF file, and what its default quantization does."""
    from gguf.constants import LlamaFileType

    with GGUFFile(path) as gf:
        arch = gf.architecture
        params = sum(int(_numel(t.shape)) for t in gf.tensors.values())
        types = Counter(t.type_name for t in gf.tensors.values() if len(t.shape) > 1)
        file_type = gf.get("general.file_type")
    try:
        kind = LlamaFileType(int(file_type)).name.removeprefix("MOSTLY_")
    except (TypeError, ValueError):
        kind = "/".join(sorted(types))
    if quantization == "gguf":
        kept = sorted(t for t in types if t in block_types())
        dense = sorted(t for t in types if t not in block_types() and t != "F32")
        quant = "gguf: " + "; ".join(
            part for part in (f"{', '.join(kept)} in blocks" if kept else "",
                              f"{', '.join(dense)} dequantized" if dense else "") if part)
    else:
        quant = "none (dequantized)"
    return {"family": ARCHITECTURES.get(arch, arch),
            "size": f"{_bytes(path.stat().st_size)}, {_count(params)} params",
            "format": f"GGUF {kind}", "quantization": quant}


def _bytes(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.0f}M"


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def list_models() -> list[dict[str, Any]]:
    rows = []
    for model in catalog.CATALOG:
        row = {"name": model.name, "family": "-", "size": "-", "format": "-",
               "quantization": "-", "path": ""}
        path = catalog.installed_file(model)
        if path is None:
            row["status"] = f"not installed: {model.pull_hint()}"
        elif not path.is_file():  # parts installed, not yet assembled
            row["status"] = "installed (assembled on first load)"
        else:
            row.update(describe_gguf(path, model.quantization), status="installed",
                       path=str(path))
        rows.append(row)
    for record_file in sorted((cache_dir() / "models" / "gguf").glob("*/gguf.json")):
        try:
            record = json.loads(record_file.read_text())
            path = Path(record["gguf"])
            row = describe_gguf(path, record.get("quantization"))
        except (OSError, ValueError, KeyError, GGUFFormatError):
            continue  # the file is gone or changed: not listed
        rows.append({"name": str(path), **row, "status": "opened before", "path": str(path)})
    return rows
