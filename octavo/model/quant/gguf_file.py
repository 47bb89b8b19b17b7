"""Reading a GGUF file fast: its metadata and tensor table from the header, its tensors as
views of one read-only memory map.

gguf-py's GGUFReader builds numpy objects for every metadata item, the tokenizer's hundreds of
thousands of strings included (16 s for a 1.5B model's file on this project's 2-core machines);
loading needs only the scalars and the tensor table, so long arrays are skipped here and read
only when asked for (`array`). A tensor's bytes stay in the file's pages until someone copies
them: `raw` is a view, `dequantize` makes the one fp32 copy a tensor needs (gguf-py's
dequantization, which transformers' GGUF loading runs too, so the numbers are the same).
"""

from __future__ import annotations

import contextlib
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

_MAGIC = b"GGUF"
# GGUF metadata value types -> struct format of a scalar (8 string, 9 array are variable length)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_SHORT_ARRAY = 1024  # arrays up to this many items are read with the header, longer on demand
_DEFAULT_ALIGNMENT = 32


class GGUFFormatError(ValueError):
    """The file is not a GGUF file octavo can read."""


@dataclass(frozen=True, slots=True)
class LongArray:
    """A metadata array left in the file: its item type, length and where its items start."""
    item_type: int
    count: int
    offset: int


@dataclass(frozen=True, slots=True)
class TensorInfo:
    name: str
    type_id: int
    type_name: str  # GGML's name: F32, Q8_0, Q4_K, ...
    shape: tuple[int, ...]  # numpy order: rows before columns (GGUF lists them reversed)
    offset: int  # absolute, in the file
    nbytes: int

    @property
    def rows(self) -> int:
        return int(np.prod(self.shape[:-1])) if len(self.shape) > 1 else 1

    @property
    def cols(self) -> int:
        return self.shape[-1]


class GGUFFile:
    """One GGUF file: `metadata` (key -> value; long arrays as LongArray), `tensors` (name ->
    TensorInfo, in file order). Close it (or use it as a context manager) to drop the map."""

    def __init__(self, path: str | Path) -> None:
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

        self.path = Path(path)
        with self.path.open("rb") as f:
            try:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except ValueError as e:  # an empty file
                raise GGUFFormatError(f"{str(self.path)!r} is not a GGUF file (empty)") from e
        try:
            self.metadata: dict[str, Any] = {}
            self.tensors: dict[str, TensorInfo] = {}
            self._parse(GGML_QUANT_SIZES, GGMLQuantizationType)
        except BaseException:
            self._map.close()
            raise
        self._array: np.ndarray | None = None

    # ---- the header ---------------------------------------------------------------------
    def _need(self, pos: int, n: int) -> None:
        if pos + n > len(self._map):
            raise GGUFFormatError(f"{str(self.path)!r}: truncated GGUF file")

    def _unpack(self, fmt: str, pos: int) -> tuple[Any, int]:
        size = struct.calcsize(fmt)
        self._need(pos, size)
        return struct.unpack_from(fmt, self._map, pos)[0], pos + size

    def _string(self, pos: int) -> tuple[str, int]:
        n, pos = self._unpack("<Q", pos)
        self._need(pos, n)
        return self._map[pos:pos + n].decode("utf-8", errors="replace"), pos + n

    def _value(self, value_type: int, pos: int) -> tuple[Any, int]:
        if value_type in _SCALARS:
            return self._unpack(_SCALARS[value_type], pos)
        if value_type == _STRING:
            return self._string(pos)
        if value_type == _ARRAY:
            item_type, pos = self._unpack("<I", pos)
            count, pos = self._unpack("<Q", pos)
            if count <= _SHORT_ARRAY:
                items = []
                for _ in range(count):
                    item, pos = self._value(item_type, pos)
                    items.append(item)
                return items, pos
            start = pos
            if item_type in _SCALARS:
                pos += count * struct.calcsize(_SCALARS[item_type])
                self._need(pos, 0)
            elif item_type == _STRING:  # the tokenizer's: lengths only, nothing decoded
                unpack, m = struct.unpack_from, self._map
                for _ in range(count):
                    pos += 8 + unpack("<Q", m, pos)[0]
                self._need(pos, 0)
            else:
                for _ in range(count):
                    pos = self._value(item_type, pos)[1]
            return LongArray(item_type, count, start), pos
        raise GGUFFormatError(f"{str(self.path)!r}: unknown GGUF metadata type {value_type}")

    def _parse(self, quant_sizes, quant_types) -> None:
        if len(self._map) < 8 or self._map[:4] != _MAGIC:
            raise GGUFFormatError(f"{str(self.path)!r} is not a GGUF file (no GGUF magic)")
        version, pos = self._unpack("<I", 4)
        if version not in (2, 3):
            raise GGUFFormatError(f"{str(self.path)!r}: unsupported GGUF version {version}")
        n_tensors, pos = self._unpack("<Q", pos)
        n_kv, pos = self._unpack("<Q", pos)
        for _ in range(n_kv):
            key, pos = self._string(pos)
            value_type, pos = self._unpack("<I", pos)
            self.metadata[key], pos = self._value(value_type, pos)
        infos = []
        for _ in range(n_tensors):
            name, pos = self._string(pos)
            n_dims, pos = self._unpack("<I", pos)
            dims = []
            for _ in range(n_dims):
                d, pos = self._unpack("<Q", pos)
                dims.append(d)
            type_id, pos = self._unpack("<I", pos)
            offset, pos = self._unpack("<Q", pos)
            infos.append((name, tuple(reversed(dims)), type_id, offset))
        alignment = int(self.metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
        data_start = (pos + alignment - 1) // alignment * alignment
        for name, shape, type_id, offset in infos:
            try:
                qtype = quant_types(type_id)
            except ValueError:
                raise GGUFFormatError(f"{str(self.path)!r}: tensor {name!r} has unknown GGML "
                                      f"type {type_id}") from None
            block, size = quant_sizes[qtype]
            numel = int(np.prod(shape)) if shape else 1
            if shape and shape[-1] % block:
                raise GGUFFormatError(f"{str(self.path)!r}: tensor {name!r} has {shape[-1]} "
                                      f"columns, not whole {qtype.name} blocks of {block}")
            info = TensorInfo(name, type_id, qtype.name, shape, data_start + offset,
                              numel // block * size)
            self._need(info.offset, info.nbytes)
            self.tensors[name] = info

    # ---- metadata -------------------------------------------------------------------------
    @property
    def architecture(self) -> str:
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise GGUFFormatError(f"{str(self.path)!r} has no general.architecture in its "
                                  "metadata")
        return arch

    def get(self, key: str, default: Any = None) -> Any:
        """A metadata value (a long array read in full)."""
        value = self.metadata.get(key, default)
        return self.array(key) if isinstance(value, LongArray) else value

    def arch_get(self, key: str, default: Any = None) -> Any:
        """`{architecture}.{key}`, as llama.cpp names the model's hyperparameters."""
        return self.get(f"{self.architecture}.{key}", default)

    def array(self, key: str) -> list[Any]:
        value = self.metadata[key]
        if not isinstance(value, LongArray):
            return list(value)
        pos, items = value.offset, []
        for _ in range(value.count):
            item, pos = self._value(value.item_type, pos)
            items.append(item)
        return items

    @property
    def tensor_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    # ---- tensors --------------------------------------------------------------------------
    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes as uint8 [rows, bytes per row] (a view of the map)."""
        info = self.tensors[name]
        if self._array is None:
            self._array = np.frombuffer(self._map, dtype=np.uint8)
        data = self._array[info.offset:info.offset + info.nbytes]
        return data.reshape(info.rows, -1)

    def dequantize(self, name: str) -> np.ndarray:
        """The tensor in fp32, numpy shape (gguf-py's dequantization: transformers' numbers)."""
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        info = self.tensors[name]
        raw = self.raw(name)
        if info.type_name == "F32":
            out = raw.view(np.float32).copy()
        else:
            out = dequantize(raw, GGMLQuantizationType(info.type_id)).astype(np.float32,
                                                                              copy=False)
        return out.reshape(info.shape)

    def close(self) -> None:
        self._array = None
        # a view still exported keeps the map: it goes when the last view does
        with contextlib.suppress(BufferError):
            self._map.close()

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
