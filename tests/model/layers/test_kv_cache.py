"""Block copies and swaps move exactly the blocks they name, for every layer."""

from __future__ import annotations

import torch

from octavo.config import ModelConfig
from octavo.model.layers.kv_cache import KVCache
from tests.conftest import TINY_CONFIG


def make_cache(num_blocks: int = 8, host: int = 4) -> KVCache:
    config = ModelConfig.from_hf_dict({**TINY_CONFIG, "model_type": "llama"})
    cache = KVCache(config, num_blocks, 4, torch.float32, torch.device("cpu"), host)
    cache.device_cache.copy_(torch.randn_like(cache.device_cache))
    return cache


def test_copy_blocks_copies_only_named_blocks():
    cache = make_cache()
    before = cache.device_cache.clone()
    cache.copy_blocks([(1, 5), (3, 6)])
    after = cache.device_cache
    assert torch.equal(after[:, :, 5], before[:, :, 1])
    assert torch.equal(after[:, :, 6], before[:, :, 3])
    untouched = [0, 1, 2, 3, 4, 7]
    assert torch.equal(after[:, :, untouched], before[:, :, untouched])


def test_swap_round_trip():
    cache = make_cache()
    before = cache.device_cache.clone()
    cache.swap_out([(2, 0), (7, 3)])
    assert torch.equal(cache.host_cache[:, :, 0], before[:, :, 2])
    assert torch.equal(cache.host_cache[:, :, 3], before[:, :, 7])
    cache.device_cache[:, :, [2, 7]] = 0
    cache.swap_in([(0, 4), (3, 1)])
    assert torch.equal(cache.device_cache[:, :, 4], before[:, :, 2])
    assert torch.equal(cache.device_cache[:, :, 1], before[:, :, 7])
