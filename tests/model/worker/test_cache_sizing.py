"""KV cache sizing, decided by the runner once the weights are in memory."""

from __future__ import annotations

import pytest
import torch

from octavo.config import ModelConfig
from octavo.engine_args import EngineArgs
from octavo.model.worker.cache_sizing import DEFAULT_CPU_KV_CACHE_BYTES, size_kv_blocks
from tests.conftest import ON_CUDA, TEST_DEVICE, TINY_CONFIG

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


def test_cuda_budget_sets_the_graph_pool_aside_too():
    info = lambda device: (50 * GIB, 80 * GIB)  # noqa: E731
    got = size_kv_blocks(EngineArgs(gpu_memory_utilization=0.9), CONFIG, torch.float32, CUDA,
                         mem_get_info=info, activation_peak=lambda: 2 * GIB,
                         graph_pool=lambda: GIB)
    assert got.num_blocks == int(80 * GIB * 0.9 - 30 * GIB - 2 * GIB - GIB) // BLOCK_BYTES
    with pytest.raises(ValueError, match="the CUDA graphs' pool 43.00 GiB"):
        size_kv_blocks(EngineArgs(), CONFIG, torch.float32, CUDA, mem_get_info=info,
                       graph_pool=lambda: 43 * GIB)


def test_swap_space_is_sized_on_its_own():
    """A GPU's KV cache is not mirrored in pinned host memory: swap gets swap_space GiB (4 by
    default, vLLM's), never more blocks than the device by default."""
    info = lambda device: (70 * GIB, 80 * GIB)  # noqa: E731 - a 62 GiB KV cache
    swap = EngineArgs(preemption_mode="swap")
    got = size_kv_blocks(swap, CONFIG, torch.float32, CUDA, mem_get_info=info)
    assert got.num_blocks == int(62 * GIB) // BLOCK_BYTES
    assert got.num_host_blocks == 4 * GIB // BLOCK_BYTES
    explicit = size_kv_blocks(EngineArgs(preemption_mode="swap", swap_space=0.5), CONFIG,
                              torch.float32, CUDA, mem_get_info=info)
    assert explicit.num_host_blocks == GIB // 2 // BLOCK_BYTES
    assert size_kv_blocks(EngineArgs(), CONFIG, torch.float32, CUDA,
                          mem_get_info=info).num_host_blocks == 0


@pytest.fixture(scope="module")
def runner(tiny_llama_dir):
    from octavo.model.worker.runner import ModelRunner

    args = EngineArgs(max_model_len=128, max_num_batched_tokens=300, max_num_seqs=12,
                      block_size=16)
    runner = ModelRunner(args, tiny_llama_dir, ModelConfig.from_dir(tiny_llama_dir))
    runner.init_kv_cache(8)
    return runner


def rows_asked(runner, monkeypatch) -> list[tuple[int, int]]:
    """(input tokens, logit rows) of every forward the runner's model runs from now on."""
    seen: list[tuple[int, int]] = []
    forward = runner.model.forward

    def spy(ids, positions, cache, metas, backend, rows, *rest):
        seen.append((ids.shape[0], rows.shape[0]))
        return forward(ids, positions, cache, metas, backend, rows, *rest)

    monkeypatch.setattr(runner.model, "forward", spy)
    return seen


def test_profile_runs_see_every_logit_and_the_largest_graph(runner, monkeypatch):
    """The profile run projects every one of its max_num_batched_tokens tokens to the
    vocabulary (a chunk that wants prompt logprobs does), not just max_num_seqs rows; the graph
    pool's run is a decode of the largest bucket (here on CPU, where both measure nothing),
    and neither touches the engine's own cache."""
    seen = rows_asked(runner, monkeypatch)
    before = runner.kv_cache.device_cache.clone()
    assert runner.profile_run() == 0 and runner.graph_pool_run() == 0
    assert seen == [(300, 300), (12, 12)]
    assert torch.equal(runner.kv_cache.device_cache, before)


def test_runner_sets_both_aside_where_graphs_run(runner, monkeypatch):
    info = lambda device: (50 * GIB, 80 * GIB)  # noqa: E731
    monkeypatch.setattr(runner, "device", CUDA)
    monkeypatch.setattr(runner, "profile_run", lambda: 2 * GIB)
    monkeypatch.setattr(runner, "graph_pool_run", lambda: GIB)
    args = runner.args
    for graphs, pool in ((True, GIB), (False, 0)):
        monkeypatch.setattr(runner, "use_cuda_graphs", graphs)
        want = int(80 * GIB * args.gpu_memory_utilization - 30 * GIB - 2 * GIB - pool)
        assert runner.size_kv_blocks(mem_get_info=info).num_blocks == want // BLOCK_BYTES


def test_profile_run_on_triton_kernels(tiny_llama_dir):
    """The profile run through the Triton backend on the tests' device (tests/conftest.py):
    it measures on CUDA, nothing on CPU."""
    from octavo.model.worker.runner import ModelRunner

    args = EngineArgs(max_model_len=128, max_num_batched_tokens=300, block_size=16,
                      attention_backend="triton", device=str(TEST_DEVICE))
    runner = ModelRunner(args, tiny_llama_dir, ModelConfig.from_dir(tiny_llama_dir))
    runner.init_kv_cache(8)
    before = runner.kv_cache.device_cache.clone()
    assert (runner.profile_run() > 0) == ON_CUDA
    assert torch.equal(runner.kv_cache.device_cache, before)
