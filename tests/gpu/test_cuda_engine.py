"""On a CUDA GPU (scripts/gpu_check.sh; skipped elsewhere): the engine's GPU defaults (Triton
kernels, CUDA graphs for decode) give HF transformers' greedy tokens in fp32 on the exactness
prompt set (20 prompts, 1 to 1500 tokens), batched and under preemption with chunked prefill
and prefix caching, with decode steps really replayed from graphs; enforce_eager too. The
kernel-level checks run from tests/model/kernels/test_triton_kernels.py with
OCTAVO_TEST_DEVICE=cuda."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from octavo import LLM
from tests.engine.conftest import hf_greedy
from tests.test_exactness import GREEDY, MAX_TOKENS, exactness_prompts

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA device (scripts/gpu_check.sh runs these)")


@pytest.fixture(scope="module")
def cuda_hf_tokens(default_model_dir, prompts) -> list[list[int]]:
    torch.backends.cuda.matmul.allow_tf32 = False
    model = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32)
    model = model.to("cuda").eval()
    model.generation_config.eos_token_id = None
    refs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p], device="cuda")
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=MAX_TOKENS, pad_token_id=0)
            refs.append(out[0, len(p):].tolist())
    del model
    torch.cuda.empty_cache()
    return refs


@pytest.fixture(scope="module")
def prompts(default_model_dir):
    return exactness_prompts(default_model_dir)


@pytest.mark.parametrize("options", [
    {}, {"enforce_eager": True},
    {"num_kv_blocks": 160, "max_num_batched_tokens": 256, "enable_prefix_caching": True},
], ids=["graphs", "eager", "preempt-chunked-cache"])
def test_cuda_greedy_equals_transformers(default_model_dir, prompts, cuda_hf_tokens, options):
    llm = LLM(device="cuda", dtype="float32", block_size=16, **options)
    runner = llm.engine.executor.runner
    path = runner.kernel_path()
    assert path["attention"] == "TritonAttentionBackend" and path["fused_ops"] == "triton"
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    for i, out in enumerate(outs):
        assert out.outputs[0].token_ids == cuda_hf_tokens[i], f"prompt {i} ({len(prompts[i])})"
    if options.get("enforce_eager"):
        assert runner.graphs is None
    else:
        assert runner.graphs is not None and runner.graphs.replays > 0
    if "num_kv_blocks" in options:
        assert llm.stats()["num_preemptions"] > 0
    assert llm.stats()["kv_blocks_used"] == 0
    llm.shutdown()


def test_cuda_matches_cpu_hf_reference(default_model_dir, prompts, cuda_hf_tokens):
    """HF on CUDA agrees with HF on CPU here, so the GPU run is checked against the same
    reference the CPU suite uses."""
    model = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    some = prompts[:6]
    assert hf_greedy(model, some, MAX_TOKENS) == cuda_hf_tokens[:6]
