"""The C++ decode loop (octavo/model/worker/decode_stack.py, csrc/decode_stack.cpp): where it
applies, an all-decode step runs every layer in C++ with the same kernels in the same order as the
Python layers, so tokens and logprobs are identical to decode_stack=False; where it does
not apply, the Python path runs. (Every other CPU test that decodes goes through it too: the
exactness tests against HF included.)"""

from __future__ import annotations

import pytest

from octavo import LLM, SamplingParams
from octavo.model.kernels.cpu_ops import load_cpu_ops

pytestmark = pytest.mark.skipif(load_cpu_ops() is None, reason="no compiled CPU ops")

PARAMS = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=3)
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
TINY_PROMPTS = [{"prompt_token_ids": [5, 9, 77, 120]}, {"prompt_token_ids": [200, 3]},
                {"prompt_token_ids": list(range(30, 60))}]


def run(monkeypatch, stack: bool, model=None, prompts=PROMPTS, **kwargs):
    """(token ids, logprob values) per prompt, batched (decode steps of 3 rows, then fewer),
    and whether the engine built the C++ loop."""
    llm = LLM(model, num_kv_blocks=64, max_model_len=256, enable_prefix_caching=False,
              decode_stack=stack, **kwargs)
    built = llm.engine.executor.runner.model.decode_stack is not None
    outs = llm.generate(prompts, PARAMS, use_tqdm=False)
    assert llm.stats()["kv_blocks_used"] == 0
    got = [(o.outputs[0].token_ids, [[(t, lp.logprob) for t, lp in pos.items()]
                                     for pos in o.outputs[0].logprobs]) for o in outs]
    return got, built


@pytest.mark.parametrize("kwargs", [{}, {"quantization": "gguf"}, {"quantization": "int8"}],
                         ids=["fp32", "gguf", "int8"])
def test_default_model_identical_with_and_without(monkeypatch, kwargs):
    with_stack, built = run(monkeypatch, True, **kwargs)
    assert built
    without, built = run(monkeypatch, False, **kwargs)
    assert not built
    assert with_stack == without


@pytest.mark.parametrize("kwargs", [{"quantization": "int4"}, {"dtype": "bfloat16"},
                                    {"linear_backend": "torch"}],
                         ids=["int4", "bf16", "plain-linear"])
def test_tiny_model_identical_with_and_without(monkeypatch, tiny_llama_dir, kwargs):
    with_stack, built = run(monkeypatch, True, str(tiny_llama_dir), TINY_PROMPTS, **kwargs)
    assert built
    without, _ = run(monkeypatch, False, str(tiny_llama_dir), TINY_PROMPTS, **kwargs)
    assert with_stack == without


@pytest.mark.parametrize("kwargs", [{"attention_backend": "torch"}, {"fused_ops": "torch"}],
                         ids=["torch-attention", "torch-fused-ops"])
def test_python_path_where_it_does_not_apply(monkeypatch, tiny_llama_dir, kwargs):
    got, built = run(monkeypatch, True, str(tiny_llama_dir), TINY_PROMPTS, **kwargs)
    assert not built
    want, _ = run(monkeypatch, False, str(tiny_llama_dir), TINY_PROMPTS, **kwargs)
    assert got == want


def test_block_weights_past_small_batch_take_the_python_path(monkeypatch, tiny_llama_dir):
    """Decode steps of more than SMALL_BATCH rows on block weights run the tiled path in
    Python, as without the C++ loop: identical tokens and logprobs for a batch of 20."""
    from octavo.model.quant.block_quant import SMALL_BATCH

    prompts = [{"prompt_token_ids": [3 + i, 40 + 2 * i, 7]} for i in range(SMALL_BATCH + 4)]
    with_stack, built = run(monkeypatch, True, str(tiny_llama_dir), prompts,
                            quantization="int4")
    assert built
    without, _ = run(monkeypatch, False, str(tiny_llama_dir), prompts, quantization="int4")
    assert with_stack == without


WINDOW_PROMPTS = [{"prompt_token_ids": [(7 * i + 3) % 250 + 3 for i in range(n)]}
                  for n in (3, 30, 70)]  # past every window below, with the 20 new tokens


@pytest.fixture(scope="module", params=["gemma2", "gemma3_text", "qwen3", "mistral", "qwen2"])
def family_dir(request, tmp_path_factory):
    """Tiny random models of the other layer shapes the loop runs: Gemma's sandwich layers
    (soft caps; q/k norms and a second rope table), Qwen3's q/k norms, sliding windows on every
    layer (Mistral) and on some (Qwen2: two KV cache groups)."""
    from tests.model.models import test_families, test_gemma

    path = tmp_path_factory.mktemp(request.param)
    if request.param.startswith("gemma"):
        return request.param, test_gemma.build(path, request.param)
    return request.param, test_families.build(path, request.param)


@pytest.mark.parametrize("kwargs", [{}, {"quantization": "int8"}, {"kv_cache_dtype": "int8"},
                                    {"kv_cache_dtype": "fp8_e4m3"}],
                         ids=["fp32", "int8-weights", "int8-kv", "fp8-kv"])
def test_other_layer_shapes_identical_with_and_without(monkeypatch, family_dir, kwargs):
    name, path = family_dir
    with_stack, built = run(monkeypatch, True, str(path), WINDOW_PROMPTS, **kwargs)
    assert built, f"{name}: the C++ loop was not built"
    without, built = run(monkeypatch, False, str(path), WINDOW_PROMPTS, **kwargs)
    assert not built
    assert with_stack == without


def test_gemma_outside_float32_takes_the_python_path(tmp_path):
    """Gemma's fused norm is for fp32 rows: a Gemma computing in bf16 keeps the Python layers
    (on a CPU without native bf16, dtype=bfloat16 computes in fp32, and the loop runs)."""
    import torch

    from tests.model.models import test_gemma

    path = test_gemma.build(tmp_path / "g3", "gemma3_text")
    llm = LLM(str(path), num_kv_blocks=16, max_model_len=128, dtype="bfloat16")
    runner = llm.engine.executor.runner
    assert (runner.model.decode_stack is not None) == (runner.dtype == torch.float32)
