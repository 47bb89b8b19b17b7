"""A model directory's safetensors checkpoint, read tensor by tensor and region by region.

`SafetensorsCheckpoint` maps each tensor name to a lazy tensor (layers/weights.py) whose bytes
are read only when the loader copies it into a parameter, and then only the region a
tensor-parallel rank keeps, through safetensors' `get_slice` (the file is memory-mapped, so a
region costs what it holds). Nothing is read at opening but the files' headers. Which file
holds a tensor: `model.safetensors.index.json`'s weight map where there is one, else every
`*.safetensors` file of the directory (the first file naming a tensor wins, in name order).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from octavo.model.layers.weights import Index, Stored

# safetensors' dtype names (get_slice().get_dtype()) -> torch
DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
          "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32, "I16": torch.int16,
          "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}


class SafetensorsCheckpoint(Mapping[str, Stored]):
    """The checkpoint of `model_dir`, open until `close()` (or the end of a `with`)."""

    def __init__(self, model_dir: Path) -> None:
        self._stack = contextlib.ExitStack()
        self._files: dict[Path, Any] = {}
        self._where: dict[str, Path] = {}
        index = model_dir / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            self._where = {name: model_dir / file for name, file in weight_map.items()}
        else:
            for file in sorted(model_dir.glob("*.safetensors")):
                for name in self._open(file).keys():  # noqa: SIM118 (not a mapping)
                    self._where.setdefault(name, file)
        if not self._where:
            raise ValueError(f"{model_dir} holds no *.safetensors checkpoint")

    def _open(self, file: Path) -> Any:
        handle = self._files.get(file)
        if handle is None:
            handle = self._stack.enter_context(safe_open(str(file), framework="pt",
                                                         device="cpu"))
            self._files[file] = handle
        return handle

    def __getitem__(self, name: str) -> Stored:
        file = self._where[name]
        part = self._open(file).get_slice(name)
        dtype = part.get_dtype()
        if dtype not in DTYPES:
            raise ValueError(f"checkpoint tensor {name!r} has dtype {dtype}, which octavo "
                             f"does not load")

        def read(index: Index) -> torch.Tensor:
            return part[index] if index else part[:]

        return Stored(part.get_shape(), DTYPES[dtype], read)

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, name: object) -> bool:
        return name in self._where

    def close(self) -> None:
        self._stack.close()
        self._files.clear()

    def __enter__(self) -> SafetensorsCheckpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
