"""All-reduce and all-gather through shared memory, for tensor-parallel ranks on one machine.

gloo's collectives go through TCP over loopback: tens to hundreds of microseconds per call,
and a decode step makes two per layer. Ranks on one machine can instead meet in a shared
memory segment (vLLM's CPU backend does the same): each rank copies its tensor into its own
slot, raises its flag to the call's number, waits until every rank's flag has reached it,
then reads the slots. The sum runs over the slots in rank order on every rank, so each rank
gets the same bits (the ranks' residual streams stay identical).

Each rank has two slots and alternates between them: a rank can only reuse a slot two calls
later, by which time every rank has passed the call in between, and so has finished reading
it. The flags are plain 8-byte stores after the data's; on x86 (total store order) a rank
that sees a flag sees the data written before it, which is why this runs on x86 only.
A tensor larger than a slot goes through gloo instead.

The segment is a file in /dev/shm that rank 0 creates and removes once every rank has mapped
it, so nothing is left behind even if a rank is killed.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import platform
import time
import uuid
from pathlib import Path

import numpy as np
import torch

import octavo.envs as envs

FLAG_STRIDE = 8  # int64s per rank's flag: one 64-byte cache line each
SPINS_BEFORE_YIELD = 2000


def shm_usable() -> bool:
    """Shared-memory collectives: x86 (total store order) with /dev/shm, unless
    OCTAVO_TP_SHM=0."""
    if not envs.tp_shared_memory():
        return False
    return platform.machine().lower() in ("x86_64", "amd64") and Path("/dev/shm").is_dir()


class ShmComm:
    def __init__(self, path: str, rank: int, size: int, slot_bytes: int, create: bool,
                 timeout_s: float) -> None:
        self.rank, self.size = rank, size
        self.slot_bytes = slot_bytes
        self.timeout_s = timeout_s
        header = size * FLAG_STRIDE * 8
        self.total = header + 2 * size * slot_bytes
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, self.total)
            self.mm = mmap.mmap(fd, self.total)
        finally:
            os.close(fd)
        self.flags = np.frombuffer(self.mm, dtype=np.int64, count=size * FLAG_STRIDE)
        self.data = torch.frombuffer(self.mm, dtype=torch.uint8, offset=header,
                                     count=2 * size * slot_bytes)
        self.calls = 0

    @staticmethod
    def new_path() -> str:
        return f"/dev/shm/octavo-tp-{uuid.uuid4().hex}"

    def fits(self, x: torch.Tensor) -> bool:
        return x.numel() * x.element_size() <= self.slot_bytes

    def _slot(self, rank: int, parity: int, x: torch.Tensor) -> torch.Tensor:
        start = (parity * self.size + rank) * self.slot_bytes
        n = x.numel() * x.element_size()
        return self.data[start : start + n].view(x.dtype).view(x.shape)

    def _exchange(self, x: torch.Tensor) -> int:
        """Put x in this rank's slot and wait for every rank's; the slots' parity."""
        self.calls += 1
        call, parity = self.calls, self.calls % 2
        self._slot(self.rank, parity, x).copy_(x)
        flags = self.flags
        flags[self.rank * FLAG_STRIDE] = call
        others = [r * FLAG_STRIDE for r in range(self.size) if r != self.rank]
        spins = 0
        deadline = 0.0
        for index in others:
            while flags[index] < call:
                spins += 1
                if spins > SPINS_BEFORE_YIELD:  # a rank is slow (or gone): stop burning a core
                    now = time.monotonic()
                    if not deadline:
                        deadline = now + self.timeout_s
                    elif now > deadline:
                        raise RuntimeError(
                            f"shared-memory collective: rank {index // FLAG_STRIDE} did not "
                            f"arrive within {self.timeout_s:.0f} s")
                    os.sched_yield()
        return parity

    def all_reduce_(self, x: torch.Tensor) -> torch.Tensor:
        """x <- the sum of every rank's x, added in rank order (the same bits on each rank)."""
        parity = self._exchange(x)
        torch.add(self._slot(0, parity, x), self._slot(1, parity, x), out=x)
        for r in range(2, self.size):
            x.add_(self._slot(r, parity, x))
        return x

    def all_gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's x, in rank order (copies)."""
        parity = self._exchange(x)
        return [self._slot(r, parity, x).clone() for r in range(self.size)]

    def close(self) -> None:
        self.flags = None  # type: ignore[assignment]
        self.data = None  # type: ignore[assignment]
        with contextlib.suppress(BufferError):  # a view still alive: it goes with the process
            self.mm.close()
