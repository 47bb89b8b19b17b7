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
