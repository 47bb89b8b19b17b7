"""The engine on octavo's Triton kernels (attention, KV writes, block copies and fused ops)
gives HF transformers' greedy tokens in fp32, like every other kernel path: tiny random-weight
Llama, Mistral (sliding window) and Gemma 2 (window and soft caps), with prefix caching, and
under preemption with chunked prefill. On the tests' device (tests/conftest.py): CPU tensors in
Triton's interpreter, exactly; CUDA tensors compiled, up to recorded near-ties
(tests/near_ties.py)."""

from __future__ import annotations

import pytest

from octavo import LLM, SamplingParams
from octavo.model.kernels.triton import triton_missing
from tests.conftest import ON_CUDA, TEST_DEVICE
from tests.model.models import test_families, test_gemma
from tests.near_ties import check_greedy, chosen_logprobs, hf_reference_from_dir

TRITON = dict(attention_backend="triton", fused_ops="triton", device=str(TEST_DEVICE))
FAMILIES = {"llama": (test_families.build, "mistral-full"),
            "mistral": (test_families.build, "mistral"),
            "gemma2": (test_gemma.build, "gemma2")}


TOKENS = 16  # of HF's MAX_TOKENS: greedy prefixes agree (the interpreter pays per step)


@pytest.fixture(scope="module")
def family(request, tmp_path_factory):
    assert triton_missing(TEST_DEVICE.type) is None, triton_missing(TEST_DEVICE.type)
    build, name = FAMILIES[request.param]
    path = build(tmp_path_factory.mktemp(request.param), name)
    ps = [test_families.prompts()[i] for i in (1, 3, 5, 6)]  # 37 and 160 tokens, two more
    load = {"attn_implementation": "eager"} if request.param == "gemma2" else {}  # sharing 64
    return request.param, path, ps, hf_reference_from_dir(path, ps, TOKENS, **load)


def generate(llm: LLM, prompts, params):
    """Tokens and chosen tokens' logprobs of each prompt's first sample."""
    outs = llm.generate(prompts, params, use_tqdm=False)
    return ([o.outputs[0].token_ids for o in outs],
            [chosen_logprobs(o.outputs[0]) for o in outs])


# each family with the config that exercises its kernels most: plain causal attention with
# prefix hits and under preemption, windows under preemption and chunked prefill, windows with
# soft caps and prefix hits
@pytest.mark.parametrize("family, config", [("llama", "batched-bs16-cache"),
                                            ("llama", "preempt-chunked"),
                                            ("mistral", "preempt-chunked"),
                                            ("gemma2", "batched-bs16-cache")],
                         indirect=["family"])
def test_greedy_equals_transformers_on_triton(family, config) -> None:
    name, path, ps, refs = family
    args = dict(test_families.CONFIGS[config])
    if "num_kv_blocks" not in args:  # a small cache: the interpreter copies its arguments
        args["num_kv_blocks"] = 64
    if config == "preempt-chunked":
        args["num_kv_blocks"] = 12
    llm = LLM(model=str(path), **args, **TRITON)
    params = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True, logprobs=0)
    prompts = [{"prompt_token_ids": p} for p in ps]
    tokens, logprobs = generate(llm, prompts, params)
    check_greedy(tokens, refs, exact=not ON_CUDA, got_logprobs=logprobs)
    stats = llm.stats()
    if config == "preempt-chunked":
        assert stats["num_preemptions"] > 0
    else:  # again, from the prefix cache
        tokens, logprobs = generate(llm, prompts, params)
        check_greedy(tokens, refs, exact=not ON_CUDA, got_logprobs=logprobs)
        assert llm.stats()["prefix_cache_hit_tokens"] > stats["prefix_cache_hit_tokens"]
    assert llm.stats()["kv_blocks_used"] == 0
    path = llm.engine.kernel_path()
    assert path["attention"] == "TritonAttentionBackend"
    # Gemma's norms (1 + w) run the fused rms_norm with 1 + w as its weight (fp32 rows)
    assert path["fused_ops"] == "triton"


def test_forks_copy_blocks_with_the_triton_kernel(tiny_llama_dir) -> None:
    """n=2 forks share the prompt's partial last block; the first child to write into it gets
    a copy made by the Triton copy kernel, and both continue as HF's single sequence does."""
    from octavo.model.kernels.triton.cache_ops import copy_blocks

    llm = LLM(str(tiny_llama_dir), block_size=16, num_kv_blocks=32, max_model_len=128,
              **TRITON)
    runner = llm.engine.executor.runner
    assert runner.kv_cache.block_copier is copy_blocks
    calls = []
    runner.kv_cache.block_copier = lambda cache, ids: (calls.append(ids.tolist()),
                                                      copy_blocks(cache, ids))
    prompt_ids = list(range(3, 23))  # 16 + 4 tokens
    ref = hf_reference_from_dir(tiny_llama_dir, [prompt_ids], 8)
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    prompt = {"prompt_token_ids": prompt_ids}
    single = llm.generate(prompt, greedy, use_tqdm=False)[0].outputs[0]
    check_greedy([single.token_ids], ref, exact=not ON_CUDA,
                 got_logprobs=[chosen_logprobs(single)])
    forked = llm.generate(prompt, SamplingParams(n=2, temperature=0, max_tokens=8,
                                                 ignore_eos=True, logprobs=0),
                          use_tqdm=False)[0]
    assert [len(c) for c in calls] == [1]
    check_greedy([o.token_ids for o in forked.outputs], ref.pick([0, 0]), exact=not ON_CUDA,
                 got_logprobs=[chosen_logprobs(o) for o in forked.outputs])
    assert llm.stats()["kv_blocks_used"] == 0
