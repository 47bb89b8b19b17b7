"""KV cache sizing, decided by the runner once the weights are in memory."""

from __future__ import annotations

import pytest
import torch

from octavo.config import ModelConfig
from octavo.engine_args import EngineArgs
from octavo.model.worker.cache_sizing import DEFAULT_CPU_KV_CACHE_BYTES, size_kv_blocks
from tests.conftest import TINY_CONFIG

CONFIG = ModelConfig.from_hf_dict({**TINY_CONFIG, "model_type": "llama"})
GIB = 1 << 30
CUDA = torch.device("cuda")
# 2 layers x 2 (K, V) x 2 KV heads x 16 dims x 4 bytes x 16 tokens
BLOCK_BYTES = 2 * 2 * 2 * 16 * 4 * 16


def test_cuda_budget_is_utilization_of_total_minus_what_is_in_use_after_loading():
    # 80 GiB device, 30 GiB in use once the weights are loaded (ours and anyone else's)
    info = lambda device: (50 * GIB, 80 * GIB)  # noqa: E731
    got = size_kv_blocks(EngineArgs(gpu_memory_utilization=0.9), CONFIG, torch.float32, CUDA,
                         mem_get_info=info)
    assert got.block_bytes == BLOCK_BYTES
    assert got.num_blocks == int(80 * GIB * 0.9 - 30 * GIB) // BLOCK_BYTES
    assert got.num_host_blocks == 0


def test_cuda_with_no_memory_left_is_a_clear_error():
    info = lambda device: (5 * GIB, 80 * GIB)  # noqa: E731 - 75 GiB in use, cap 72
    with pytest.raises(ValueError, match="gpu_memory_utilization=0.9 leaves no memory"):
        size_kv_blocks(EngineArgs(), CONFIG, torch.float32, CUDA, mem_get_info=info)


def test_explicit_sizes_win_and_cpu_has_a_fixed_default():
    cpu = torch.device("cpu")
    assert size_kv_blocks(EngineArgs(num_kv_blocks=7), CONFIG, torch.float32, cpu).num_blocks == 7
    got = size_kv_blocks(EngineArgs(kv_cache_memory_bytes=10 * BLOCK_BYTES + 5), CONFIG,
                         torch.float32, cpu)
    assert got.num_blocks == 10
    assert size_kv_blocks(EngineArgs(), CONFIG, torch.float32, cpu).num_blocks == (
        DEFAULT_CPU_KV_CACHE_BYTES // BLOCK_BYTES)
    swap = size_kv_blocks(EngineArgs(num_kv_blocks=7, preemption_mode="swap"), CONFIG,
                          torch.float32, cpu)
    assert swap.num_host_blocks == 7
    sized = size_kv_blocks(EngineArgs(num_kv_blocks=7, swap_space=BLOCK_BYTES * 3 / GIB),
                           CONFIG, torch.float32, cpu)
    assert sized.num_host_blocks == 3
    with pytest.raises(ValueError, match="smaller than one KV block"):
        size_kv_blocks(EngineArgs(kv_cache_memory_bytes=100), CONFIG, torch.float32, cpu)


def test_cuda_budget_sets_the_profiled_activation_peak_aside():
    """The profile run's activation peak comes off the KV budget; it runs only where the
    budget comes from gpu_memory_utilization."""
    info = lambda device: (50 * GIB, 80 * GIB)  # noqa: E731
    runs = []

    def peak() -> int:
        runs.append(1)
        return 2 * GIB

    got = size_kv_blocks(EngineArgs(gpu_memory_utilization=0.9), CONFIG, torch.float32, CUDA,
                         mem_get_info=info, activation_peak=peak)
    assert got.num_blocks == int(80 * GIB * 0.9 - 30 * GIB - 2 * GIB) // BLOCK_BYTES
    assert runs == [1]
    size_kv_blocks(EngineArgs(num_kv_blocks=7), CONFIG, torch.float32, CUDA,
                   mem_get_info=info, activation_peak=peak)
    assert runs == [1]
    with pytest.raises(ValueError, match="activations need 43.00 GiB"):
        size_kv_blocks(EngineArgs(), CONFIG, torch.float32, CUDA, mem_get_info=info,
                       activation_peak=lambda: 43 * GIB)


@pytest.mark.parametrize("kernels", [{}, {"attention_backend": "triton"}])
def test_profile_run_runs_the_largest_step_and_leaves_the_cache_alone(tiny_llama_dir, kernels):
    """The profile run pushes max_num_batched_tokens through the model (here on CPU, where it
    measures nothing) without touching the engine's own cache."""
    from octavo.model.worker.runner import ModelRunner

    args = EngineArgs(max_model_len=128, max_num_batched_tokens=300, block_size=16, **kernels)
    runner = ModelRunner(args, tiny_llama_dir, ModelConfig.from_dir(tiny_llama_dir))
    runner.init_kv_cache(8)
    before = runner.kv_cache.device_cache.clone()
    assert runner.profile_run() == 0
    assert torch.equal(runner.kv_cache.device_cache, before)
