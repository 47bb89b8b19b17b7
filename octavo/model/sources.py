"""Finding model directories: an HF directory, a GGUF file, or an installed model by name.

`resolve_model_dir(model)` accepts:

- ``None``: the embedded default model, SmolLM2-135M-Instruct (also by name, see below);
- an HF directory (``config.json`` plus ``*.safetensors``), used as it is;
- a path to a ``.gguf`` file, or a directory holding exactly one ``.gguf`` file and no
  ``config.json``: its config and tokenizer are written once into
  ``$OCTAVO_CACHE/models/gguf/<stem>-<key>`` (small files, no weights: the loader reads those
  from the GGUF file, model/gguf_loader.py), the key a hash of the file's resolved path, size
  and mtime (a changed file gets a new directory);
- the name of an installed model (case-insensitive; a path of that name wins): see
  catalog.py (``smollm2-135m-instruct``, ``gemma-3-270m``, ``qwen2.5-coder-1.5b``); its
  directory is ``$OCTAVO_CACHE/models/<name>``.

A GGUF model's directory records its file and what ``quantization="auto"`` runs it with
(gguf.json): ``gguf`` (its blocks kept, as llama.cpp and vLLM run GGUF files) for every GGUF
file but the embedded default model, which runs dequantized so that the default engine is
exact against HF transformers in fp32. Everything runs offline.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

from octavo.config import ModelConfig
from octavo.envs import cache_dir
from octavo.model import catalog
from octavo.model.quant import gguf_convert

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"  # the default model's directory in the cache
GGUF_RECORD = gguf_convert.GGUF_RECORD


def default_model_dir() -> Path:
    return cache_dir() / "models" / DEFAULT_MODEL_NAME


def _model_dir(model: catalog.CatalogModel) -> Path:
    return default_model_dir() if model is catalog.DEFAULT else cache_dir() / "models" / model.name


def find_embedded_gguf() -> Path:
    """The default model's GGUF inside its installed package."""
    return catalog.gguf_path(catalog.DEFAULT)


def _read_record(model_dir: Path) -> dict[str, Any] | None:
    try:
        return json.loads((model_dir / GGUF_RECORD).read_text())
    except (OSError, ValueError):
        return None


def _ready(model_dir: Path) -> bool:
    """A GGUF model directory of this version: its record and config, and no weights (an
    older octavo converted every tensor into model.safetensors there)."""
    return (_read_record(model_dir) is not None and (model_dir / "config.json").is_file()
            and not (model_dir / "model.safetensors").exists())


def _ensure_dir(gguf_path: Path, out: Path, quantization: str | None) -> Path:
    if not _ready(out):
        gguf_convert.check_supported(gguf_path)
        record = {"gguf": str(gguf_path.resolve()), "quantization": quantization}
        gguf_convert.write_model_dir(gguf_path.resolve(), out, record)
    return out


def ensure_default_model() -> Path:
    return ensure_catalog_model(catalog.DEFAULT)


def ensure_catalog_model(model: catalog.CatalogModel) -> Path:
    """An installed model's directory (its GGUF found or assembled, its config written once)."""
    gguf = catalog.gguf_path(model)
    out = _model_dir(model)
    record = _read_record(out)
    if record is not None and record.get("gguf") != str(gguf.resolve()):
        shutil.rmtree(out)  # the package moved (another environment): written again
    return _ensure_dir(gguf, out, model.quantization)


def recorded_gguf(model_dir: Path) -> Path | None:
    """The GGUF file a model directory reads its weights from (None: an HF directory)."""
    record = _read_record(model_dir)
    if record is None:
        return None
    path = Path(record["gguf"])
    if not path.is_file():
        raise ValueError(f"the GGUF file {str(path)!r} the model {str(model_dir)!r} was made "
                         "from is gone")
    return path


def gguf_source(model_dir: Path) -> Path:
    """The GGUF file of a model given as one (quantization='gguf' needs it); a clear error
    for an HF directory."""
    path = recorded_gguf(model_dir)
    if path is None:
        raise ValueError(f"quantization='gguf' needs a model given as a GGUF file (a .gguf "
                         f"path or an installed model's name); {str(model_dir)!r} is an HF "
                         "directory")
    return path


def auto_quantization(model_dir: Path, device: Any, tensor_parallel: bool) -> str | None:
    """What quantization="auto" means for a model: its record's choice for a GGUF model
    ("gguf" but for the default model) where block layers run (one CPU rank), else None."""
    record = _read_record(model_dir)
    if record is None or getattr(device, "type", str(device)) != "cpu" or tensor_parallel:
        return None
    return record.get("quantization")


def gguf_cache_dir(gguf_path: Path) -> Path:
    """Where a GGUF file's config and tokenizer live: keyed by its resolved path, size and
    mtime."""
    path = gguf_path.resolve()
    st = path.stat()
    key = hashlib.sha256(f"{path}\0{st.st_size}\0{st.st_mtime_ns}".encode()).hexdigest()[:16]
    return cache_dir() / "models" / "gguf" / f"{path.stem}-{key}"


def ensure_gguf_model(gguf_path: str | os.PathLike[str]) -> Path:
    """The model directory of the GGUF file at `gguf_path` (its config written once)."""
    path = Path(gguf_path).expanduser()
    if not path.is_file():
        raise ValueError(f"GGUF file {str(path)!r} does not exist")
    return _ensure_dir(path, gguf_cache_dir(path), "gguf")


def resolve_model_dir(model: str | os.PathLike[str] | None) -> Path:
    """Return a local model directory for `model`: see the module docstring for the forms."""
    if model is None:
        return ensure_default_model()
    path = Path(model).expanduser()
    if not path.exists():
        named = catalog.find(model) if isinstance(model, str) else None
        if named is not None:
            return ensure_catalog_model(named)
        raise ValueError(
            f"model path {str(path)!r} does not exist (and is not an installed model name: "
            f"{', '.join(catalog.names())})"
        )
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ValueError(f"model path {str(path)!r} is neither a directory nor a .gguf file")
        return ensure_gguf_model(path)
    if not path.is_dir():
        raise ValueError(f"model path {str(path)!r} is not a directory")
    if _ready(path):  # a GGUF model's directory, given again
        recorded_gguf(path)
        return path
    if not (path / "config.json").is_file():
        ggufs = sorted(p for p in path.glob("*.gguf") if p.is_file())
        if len(ggufs) == 1:
            return ensure_gguf_model(ggufs[0])
        if len(ggufs) > 1:
            raise ValueError(
                f"model directory {str(path)!r} holds {len(ggufs)} .gguf files "
                f"({', '.join(p.name for p in ggufs)}); pass the path of one of them"
            )
        raise ValueError(f"model directory {str(path)!r} has no config.json and no .gguf file")
    ModelConfig.from_dir(path)  # raises a clear error if not a supported config
    if not any(path.glob("*.safetensors")):
        raise ValueError(f"model directory {str(path)!r} holds no *.safetensors weights")
    return path
