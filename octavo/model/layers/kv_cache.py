"""The preallocated paged KV cache tensors.

Layout: one tensor ``[layer_slots, 2, num_blocks, block_size, num_kv_heads, head_dim]`` (index 0
of dim 1 is K, 1 is V). `layer_slots` is the layer count of one KV cache group (see
`KVGroups` in config.py): every layer for a model with one kind of attention, fewer where local and
global layers keep separate block tables, each layer reading slot `layer_slot[l]` of its group's
blocks. A physical block is ``cache[:, :, block_id]``: ``block_size`` consecutive token slots for
every slot and KV head, so copy-on-write and swap move one block in a single indexing op, and
slot ``s = block_id * block_size + offset`` is row ``s`` of
``cache[slot, kv].view(-1, num_kv_heads, head_dim)``.

With sliding-window layers the tensor has one more block, `num_blocks` itself: the null block,
owned by no sequence and never written, which stands in the block tables for blocks freed once
they left the window.

The cache is zero-initialised: attention reads whole blocks and masks the unfilled tail, and
0 * garbage could be NaN.

With a quantized `kv_cache_dtype` (kv_quant.py) the tensor holds the stored rows: int8 values
with each row's fp32 scale in its last 4 bytes (head_dim + 4 int8 elements per row), or fp8
values; everything above (blocks, copies, swaps) is the same.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from octavo.config import ModelConfig
from octavo.model.layers.kv_quant import KVFormat


class KVCache:
    def __init__(
        self,
        config: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        num_host_blocks: int = 0,
        fmt: KVFormat | None = None,
        scales_id: str = "",
    ) -> None:
        """`scales_id`: names what decided a quantized cache's bytes beyond its format (a
        digest of an fp8 cache's per-layer scales and of the key smoothing's offsets and
        rotation), for `block_format`: the same bytes under other scales are other values."""
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.groups = groups = config.kv_groups
        self.fmt = fmt = fmt or KVFormat("auto", dtype)
        self.scales_id = scales_id
        dtype = fmt.dtype
        rows = num_blocks + 1 if groups.has_window else num_blocks
        shape = (groups.slots_per_group, 2, rows, block_size, config.num_kv_heads,
                 fmt.row_elems(config.head_dim))
        self.device_cache = torch.zeros(shape, dtype=dtype, device=device)
        host_shape = (*shape[:2], num_host_blocks, *shape[3:])
        self.null_block_id = num_blocks
        pin = device.type == "cuda"
        self.host_cache = torch.zeros(host_shape, dtype=dtype, pin_memory=pin)
        # a kernel copying blocks (cache, [n, 2] src/dst ids) in one launch; None: indexing
        self.block_copier: Callable[[torch.Tensor, torch.Tensor], None] | None = None
        # the recurrent layers' state slots (layers/recurrent/state.py), where a model has any
        self.state: Any = None

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        slot = self.groups.layer_slot[i]
        return self.device_cache[slot, 0], self.device_cache[slot, 1]

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        if not pairs:
            return
        if self.block_copier is not None:
            ids = torch.tensor(pairs, dtype=torch.long, device=self.device_cache.device)
            self.block_copier(self.device_cache, ids)
            return
        src, dst = self._index(pairs, self.device_cache.device)
        self.device_cache[:, :, dst] = self.device_cache[:, :, src]

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        if not pairs:
            return
        src, dst = self._index(pairs, self.device_cache.device)
        self.host_cache[:, :, dst.cpu()] = self.device_cache[:, :, src].cpu()

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        if not pairs:
            return
        src, dst = self._index(pairs, torch.device("cpu"))
        device = self.device_cache.device
        self.device_cache[:, :, dst.to(device)] = self.host_cache[:, :, src].to(device)

    # -- one block as bytes (the KV tier's only door into the cache) ----------------------------
    def block_format(self) -> str:
        """What the bytes of one block are: dtype and shape (and a quantized format's name, with
        fp8's scales), the KV tier's records are only read back into a cache of the same format
        (it is part of the tier's fingerprint). An int8 block carries its rows' scales."""
        shape = [d for i, d in enumerate(self.device_cache.shape) if i != 2]
        plain = f"{str(self.device_cache.dtype).removeprefix('torch.')}{shape}"
        if not self.fmt.quantized:
            return plain
        scales = f" scales {self.scales_id}" if self.scales_id else ""
        return f"{self.fmt.name} pages{scales}: {plain}"

    @property
    def block_nbytes(self) -> int:
        c = self.device_cache
        return c[:, :, 0].numel() * c.element_size()

    def read_block(self, block_id: int) -> bytes:
        """A copy of block `block_id`'s K and V for every layer slot, as bytes."""
        block = self.device_cache[:, :, block_id].contiguous()
        return block.view(torch.uint8).cpu().numpy().tobytes()

    def write_block(self, block_id: int, data: bytes | bytearray | memoryview) -> None:
        """Fill block `block_id` with bytes read_block gave (of a cache of this format)."""
        view = memoryview(data).cast("B")
        if view.nbytes != self.block_nbytes:
            raise ValueError(f"a KV block of this cache takes {self.block_nbytes} bytes, got "
                             f"{view.nbytes}")
        cache = self.device_cache
        if view.readonly:
            view = memoryview(bytearray(view))
        src = torch.frombuffer(view, dtype=torch.uint8).view(cache.dtype)
        cache[:, :, block_id] = src.view(cache[:, :, block_id].shape).to(cache.device)

    @staticmethod
    def _index(pairs: list[tuple[int, int]], device: torch.device) -> tuple[torch.Tensor, ...]:
        t = torch.tensor(pairs, dtype=torch.long, device=device)
        return t[:, 0], t[:, 1]

    @staticmethod
    def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype,
                        fmt: KVFormat | None = None) -> int:
        """One block's K and V in every layer slot, in the stored format (int8: scales too)."""
        fmt = fmt or KVFormat("auto", dtype)
        rows = 2 * config.kv_groups.slots_per_group * config.num_kv_heads
        return rows * fmt.row_bytes(config.head_dim) * block_size
