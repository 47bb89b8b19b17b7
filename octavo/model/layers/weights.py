"""The two callables a model's `_load_*` steps receive, and the lazy tensors they pass around.

`take(name)` gives a checkpoint tensor and `put(name, value)` copies a value into a parameter of
the model (cut to this rank's slice first under tensor parallelism). What `take` gives is a
`Lazy`: a description of a tensor whose bytes are read from the checkpoint only when `put`
copies it, and then only the region this rank keeps (safetensors' `get_slice`). A family that
fuses tensors (q/k/v into qkv_proj, gate/up into gate_up_proj, experts into one stack) builds
the fused value with `cat` / `stack` below, and `put` copies each part straight into its rows
of the parameter: no fused copy is ever materialized, so loading holds at most one checkpoint
tensor (or this rank's slice of it) in host memory beyond the model.

The slicing a tensor-parallel rank does (tensor_parallel.ShardPlan.shard) works on Lazy and on
plain tensors alike: basic slices, `split`, `chunk`, `cat` and `zeros_like`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

Index = tuple[slice, ...]  # one step-1 slice per dimension, bounds resolved


class Lazy:
    """A tensor read on demand: `read(index)` materializes one region of it, `copy_region`
    copies one into a tensor, as few bytes at once as it can."""

    shape: torch.Size
    dtype: torch.dtype

    def read(self, index: Index) -> torch.Tensor:
        raise NotImplementedError

    def copy_region(self, dst: torch.Tensor, index: Index) -> None:
        """dst (of the region's shape) <- the region `index` of this tensor."""
        dst.copy_(self.read(index))

    def materialize(self) -> torch.Tensor:
        return self.read(full_index(self.shape))

    def dim(self) -> int:
        return len(self.shape)

    def __getitem__(self, key) -> Lazy:
        return Sliced(self, resolve(self.shape, key))

    def split(self, sizes: Sequence[int], dim: int = 0) -> list[Lazy]:
        out, start = [], 0
        for n in sizes:
            out.append(self.narrow(dim, start, n))
            start += n
        return out

    def chunk(self, n: int, dim: int = 0) -> list[Lazy]:
        size = -(-self.shape[dim] // n)
        return self.split([min(size, self.shape[dim] - s)
                           for s in range(0, self.shape[dim], size)], dim)

    def narrow(self, dim: int, start: int, length: int) -> Lazy:
        key = [slice(None)] * len(self.shape)
        key[dim] = slice(start, start + length)
        return self[tuple(key)]


def full_index(shape: Sequence[int]) -> Index:
    return tuple(slice(0, n) for n in shape)


def resolve(shape: Sequence[int], key) -> Index:
    """`key` (basic step-1 slices, possibly fewer than dims) as one explicit slice per dim."""
    key = key if isinstance(key, tuple) else (key,)
    if len(key) > len(shape) or not all(isinstance(k, slice) for k in key):
        raise TypeError(f"a lazy tensor takes basic slices only, got {key!r}")
    out = []
    for n, k in zip(shape, key + (slice(None),) * (len(shape) - len(key)), strict=True):
        start, stop, step = k.indices(n)
        if step != 1:
            raise TypeError(f"a lazy tensor takes step-1 slices only, got {k!r}")
        out.append(slice(start, max(start, stop)))
    return tuple(out)


def _size(index: Index) -> torch.Size:
    return torch.Size(s.stop - s.start for s in index)


def _within(outer: Index, inner: Index) -> Index:
    """The region `inner` of the region `outer`, in outer's tensor's coordinates."""
    return tuple(slice(o.start + i.start, o.start + i.stop)
                 for o, i in zip(outer, inner, strict=True))


class Stored(Lazy):
    """A tensor in a file: `get(index)` reads one region (e.g. safetensors' get_slice)."""

    def __init__(self, shape: Sequence[int], dtype: torch.dtype,
                 get: Callable[[Index], torch.Tensor]) -> None:
        self.shape, self.dtype, self._get = torch.Size(shape), dtype, get

    def read(self, index: Index) -> torch.Tensor:
        return self._get(index)


class Sliced(Lazy):
    def __init__(self, base: Lazy, index: Index) -> None:
        self.base, self.index = base, index
        self.shape, self.dtype = _size(index), base.dtype

    def read(self, index: Index) -> torch.Tensor:
        return self.base.read(_within(self.index, index))

    def copy_region(self, dst: torch.Tensor, index: Index) -> None:
        self.base.copy_region(dst, _within(self.index, index))

    def __getitem__(self, key) -> Lazy:  # a slice of a slice: one slice of the base
        return Sliced(self.base, _within(self.index, resolve(self.shape, key)))


class Cat(Lazy):
    """parts concatenated along `dim`."""

    def __init__(self, parts: Sequence[Lazy], dim: int = 0) -> None:
        self.parts, self.cat_dim = list(parts), dim
        shape = list(self.parts[0].shape)
        shape[dim] = sum(p.shape[dim] for p in self.parts)
        self.shape, self.dtype = torch.Size(shape), self.parts[0].dtype

    def _pieces(self, index: Index):
        """(part, its region, where that lands along dim in the region) for each part the
        region `index` overlaps."""
        d, lo, hi, start = self.cat_dim, index[self.cat_dim].start, index[self.cat_dim].stop, 0
        for part in self.parts:
            end = start + part.shape[d]
            a, b = max(lo, start), min(hi, end)
            if a < b:
                region = list(index)
                region[d] = slice(a - start, b - start)
                yield part, tuple(region), a - lo, b - a
            start = end

    def read(self, index: Index) -> torch.Tensor:
        return torch.cat([p.read(r) for p, r, _, _ in self._pieces(index)], dim=self.cat_dim)

    def copy_region(self, dst: torch.Tensor, index: Index) -> None:
        for part, region, at, n in self._pieces(index):
            part.copy_region(dst.narrow(self.cat_dim, at, n), region)


class Stack(Lazy):
    """parts stacked along a new first dimension."""

    def __init__(self, parts: Sequence[Lazy]) -> None:
        self.parts = list(parts)
        self.shape = torch.Size([len(self.parts), *self.parts[0].shape])
        self.dtype = self.parts[0].dtype

    def read(self, index: Index) -> torch.Tensor:
        rows = range(index[0].start, index[0].stop)
        return torch.stack([self.parts[i].read(index[1:]) for i in rows])

    def copy_region(self, dst: torch.Tensor, index: Index) -> None:
        for j, i in enumerate(range(index[0].start, index[0].stop)):
            self.parts[i].copy_region(dst[j], index[1:])


class Zeros(Lazy):
    def __init__(self, shape: Sequence[int], dtype: torch.dtype) -> None:
        self.shape, self.dtype = torch.Size(shape), dtype

    def read(self, index: Index) -> torch.Tensor:
        return torch.zeros(_size(index), dtype=self.dtype)

    def copy_region(self, dst: torch.Tensor, index: Index) -> None:
        dst.zero_()


class Eager(Lazy):
    """A tensor already in memory, among lazy ones."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t, self.shape, self.dtype = t, t.shape, t.dtype

    def read(self, index: Index) -> torch.Tensor:
        return self.t[index]


Value = torch.Tensor | Lazy
Take = Callable[[str], Value]
Put = Callable[[str, Value], None]


def _lazy(v: Value) -> Lazy:
    return v if isinstance(v, Lazy) else Eager(v)


def cat(parts: Sequence[Value], dim: int = 0) -> Value:
    """torch.cat for tensors; a lazy concatenation where any part is lazy."""
    if all(isinstance(p, torch.Tensor) for p in parts):
        return torch.cat(list(parts), dim=dim)
    return Cat([_lazy(p) for p in parts], dim)


def stack(parts: Sequence[Value]) -> Value:
    if all(isinstance(p, torch.Tensor) for p in parts):
        return torch.stack(list(parts))
    return Stack([_lazy(p) for p in parts])


def zeros_like(v: Value) -> Value:
    return torch.zeros_like(v) if isinstance(v, torch.Tensor) else Zeros(v.shape, v.dtype)


def zeros(shape: Sequence[int], like: Value) -> Value:
    if isinstance(like, torch.Tensor):
        return like.new_zeros(tuple(shape))
    return Zeros(shape, like.dtype)


def copy_into(dst: torch.Tensor, value: Value) -> None:
    """dst <- value (same shape), part by part where it is lazy."""
    if isinstance(value, Lazy):
        value.copy_region(dst, full_index(value.shape))
    else:
        dst.copy_(value)
