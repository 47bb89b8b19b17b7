"""The preallocated paged KV cache tensors.

Layout: one tensor ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]`` (index 0
of dim 1 is K, 1 is V). A physical block is ``cache[:, :, block_id]``: ``block_size`` consecutive
token slots for every layer and KV head, so copy-on-write and swap move one block for all layers
in a single indexing op, and slot ``s = block_id * block_size + offset`` is row ``s`` of
``cache[layer, kv].view(-1, num_kv_heads, head_dim)``.

The cache is zero-initialised: attention reads whole blocks and masks the unfilled tail, and
0 * garbage could be NaN.
"""

from __future__ import annotations

import torch

from octavo.config import ModelConfig


class KVCache:
    def __init__(
        self,
        config: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        num_host_blocks: int = 0,
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        shape = (config.num_layers, 2, num_blocks, block_size, config.num_kv_heads, config.head_dim)
        self.device_cache = torch.zeros(shape, dtype=dtype, device=device)
        host_shape = (*shape[:2], num_host_blocks, *shape[3:])
        pin = device.type == "cuda"
        self.host_cache = torch.zeros(host_shape, dtype=dtype, pin_memory=pin)

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.device_cache[i, 0], self.device_cache[i, 1]

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        if not pairs:
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

    @staticmethod
    def _index(pairs: list[tuple[int, int]], device: torch.device) -> tuple[torch.Tensor, ...]:
        t = torch.tensor(pairs, dtype=torch.long, device=device)
        return t[:, 0], t[:, 1]

    @staticmethod
    def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return config.kv_bytes_per_token(elem) * block_size
