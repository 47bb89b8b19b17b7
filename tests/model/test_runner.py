"""The runner over a tiny random Llama matches transformers' dense forward, whatever the plan."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from octavo.config import ModelConfig
from octavo.model.runner import ModelRunner
from octavo.step_plan import SeqChunk, StepPlan
from tests.conftest import build_tiny_llama


@pytest.fixture(scope="module")
def hf_model(tiny_llama_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()


# "compiled": oneDNN linears, the C++ decode kernel and fused ops (the CPU default);
# "torch": the plain-torch fallback of each
KERNELS = {"compiled": {}, "torch": dict(backend="torch", linear_backend="torch",
                                         fused_ops="torch")}


def make_runner(model_dir, block_size: int, num_blocks: int = 200,
                kernels: str = "compiled") -> ModelRunner:
    return ModelRunner(
        model_dir, ModelConfig.from_dir(model_dir), dtype=torch.float32,
        device=torch.device("cpu"), num_blocks=num_blocks, block_size=block_size,
        max_model_len=512, **KERNELS[kernels],
    )


def hf_logits(hf, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0]


@pytest.mark.parametrize("kernels", sorted(KERNELS))
@pytest.mark.parametrize("block_size", [1, 16, 256])
def test_chunked_and_mixed_plans_match_dense(tiny_llama_dir, hf_model, block_size, kernels):
    rng = random.Random(block_size)
    runner = make_runner(tiny_llama_dir, block_size, kernels=kernels)
    free = list(range(200))
    rng.shuffle(free)
    seqs = [[rng.randrange(3, 256) for _ in range(n)] for n in (3, 40, 90, 1)]
    tables = [[free.pop() for _ in range(-(-(len(s) + 8) // block_size))] for s in seqs]
    # step 1: seq0 whole, seq1 first chunk of 25, seq2 first chunk of 60, seq3 (1 token) whole
    done = [0, 0, 0, 0]
    steps = [[3, 25, 60, 1], [1, 15, 30, 1], [1, 1, 1, 1]]
    for counts in steps:
        chunks = []
        for i, n in enumerate(counts):
            if done[i] + n > len(seqs[i]):  # extend with a "generated" token
                seqs[i].append(rng.randrange(3, 256))
            chunks.append(SeqChunk(seqs[i][done[i] : done[i] + n], done[i], tables[i]))
        out = runner.execute(StepPlan(chunks))
        for i, n in enumerate(counts):
            done[i] += n
            ref = hf_logits(hf_model, seqs[i][: done[i]])[-1]
            torch.testing.assert_close(out.logits[i], ref, atol=1e-4, rtol=1e-4)


def test_all_logits_for_prompt_logprobs(tiny_llama_dir, hf_model):
    runner = make_runner(tiny_llama_dir, 16)
    tokens = list(range(5, 45))
    out = runner.execute(StepPlan([
        SeqChunk([7, 8, 9], 0, [10], sample=True),
        SeqChunk(tokens, 0, [3, 4, 5], sample=True, all_logits=True),
    ]))
    assert out.logits.shape[0] == 2
    torch.testing.assert_close(out.all_logits[0], hf_logits(hf_model, tokens), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out.logits[1], out.all_logits[0][-1])


def test_block_copy_executes_before_forward(tiny_llama_dir, hf_model):
    runner = make_runner(tiny_llama_dir, 4)
    prompt = list(range(10, 20))  # 10 tokens: blocks 0, 1 full, block 2 holds 2 slots
    runner.execute(StepPlan([SeqChunk(prompt, 0, [0, 1, 2])]))
    # a fork writes into the shared partial block: copy it first, then decode into the copy
    out = runner.execute(StepPlan([SeqChunk([77], 10, [0, 1, 9])], block_copies=[(2, 9)]))
    ref = hf_logits(hf_model, prompt + [77])[-1]
    torch.testing.assert_close(out.logits[0], ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kernels", sorted(KERNELS))
def test_rope_scaling_and_tied_embeddings(tmp_path, kernels):
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    model_dir = build_tiny_llama(tmp_path, rope_scaling=scaling, tie_word_embeddings=True)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    runner = make_runner(model_dir, 16, kernels=kernels)
    tokens = list(range(3, 203))
    out = runner.execute(StepPlan([SeqChunk(tokens, 0, list(range(13)))]))
    torch.testing.assert_close(out.logits[0], hf_logits(hf, tokens)[-1], atol=1e-4, rtol=1e-4)


def test_kernel_switches(tiny_llama_dir):
    from octavo.model.cpu_ops import select_cpu_ops
    from octavo.model.linear import PackedLinear

    plain = make_runner(tiny_llama_dir, 16, kernels="torch")
    assert plain.model.norm.ops is None and plain.backend.name == "torch"
    assert not any(isinstance(m, PackedLinear) for m in plain.model.modules())
    with pytest.raises(ValueError, match="fused_ops='fast' is not one of"):
        select_cpu_ops("fused_ops", "fast", torch.device("cpu"), "OCTAVO_FUSED_OPS")
