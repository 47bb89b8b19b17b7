"""The runner over a tiny random Llama matches transformers' dense forward, whatever the plan,
and keeps each sequence's tokens and block table between steps."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from octavo.sampling_params import SamplingParams
from octavo.step_plan import SeqChunk, StepPlan
from tests.conftest import build_tiny_llama
from tests.model.plans import KERNELS, chunk, dense_logits, make_runner, new_seq


@pytest.fixture(scope="module")
def hf_model(tiny_llama_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()


@pytest.mark.parametrize("kernels", sorted(KERNELS))
@pytest.mark.parametrize("block_size", [1, 16, 256])
def test_chunked_and_mixed_plans_match_dense(tiny_llama_dir, hf_model, block_size, kernels):
    rng = random.Random(block_size)
    runner = make_runner(tiny_llama_dir, block_size, kernels=kernels)
    free = list(range(200))
    rng.shuffle(free)
    seqs = [[rng.randrange(3, 256) for _ in range(n)] for n in (3, 40, 90, 1)]
    tables = [[free.pop() for _ in range(-(-(len(s) + 8) // block_size))] for s in seqs]
    # the runner learns each sequence (and its whole block table) once, in the first plan;
    # later plans name it by id and carry only the new tokens
    first = [new_seq(i, s, t) for i, (s, t) in enumerate(zip(seqs, tables, strict=True))]
    # step 1: seq0 whole, seq1 first chunk of 25, seq2 first chunk of 60, seq3 (1 token) whole
    done = [0, 0, 0, 0]
    steps = [[3, 25, 60, 1], [1, 15, 30, 1], [1, 1, 1, 1]]
    for step, counts in enumerate(steps):
        chunks = []
        for i, n in enumerate(counts):
            if done[i] + n > len(seqs[i]):  # extend with a "generated" token
                seqs[i].append(rng.randrange(3, 256))
            chunks.append(chunk(i, seqs[i][done[i] : done[i] + n], done[i]))
        logits = runner.forward(StepPlan(chunks, first if step == 0 else []))
        for i, n in enumerate(counts):
            done[i] += n
            ref = dense_logits(hf_model, seqs[i][: done[i]])[-1]
            torch.testing.assert_close(logits.sample[i], ref, atol=1e-4, rtol=1e-4)
            known = max(done[i], len(first[i].token_ids))
            assert runner.batch.seqs[i].token_ids == seqs[i][:known]


def test_prompt_logits_for_prompt_logprobs(tiny_llama_dir, hf_model):
    runner = make_runner(tiny_llama_dir, 16)
    tokens = list(range(5, 45))
    logits = runner.forward(StepPlan(
        [chunk(0, [7, 8, 9], 0), chunk(1, tokens, 0, prompt_logprobs=True)],
        [new_seq(0, [7, 8, 9], [10]), new_seq(1, tokens, [3, 4, 5])],
    ))
    assert logits.sample.shape[0] == 2
    torch.testing.assert_close(logits.prompt[1], dense_logits(hf_model, tokens), atol=1e-4,
                               rtol=1e-4)
    torch.testing.assert_close(logits.sample[1], logits.prompt[1][-1])


def test_execute_samples_and_scores_prompt_tokens(tiny_llama_dir, hf_model):
    """execute() = forward + sampling: greedy rows take the argmax, a fan-out samples several
    sequences from one chunk's logits, prompt logprobs score each next prompt token."""
    runner = make_runner(tiny_llama_dir, 16)
    tokens = list(range(5, 45))
    scored = SamplingParams(temperature=0, prompt_logprobs=2, logprobs=1)
    sampled = SamplingParams(temperature=1.0, seed=7)
    out = runner.execute(StepPlan(
        [chunk(0, tokens, 0, prompt_logprobs=True), SeqChunk(1, tokens, 0, (1, 2, 3))],
        [new_seq(0, tokens, [0, 1, 2], scored), new_seq(1, tokens, [3, 4, 5], sampled),
         new_seq(2, tokens, [3, 4, 5], sampled, index=1),
         new_seq(3, tokens, [3, 4, 5], sampled, index=2)],
    ))
    ref = dense_logits(hf_model, tokens)
    assert out.sampled_token_ids[0] == [int(ref[-1].argmax())]
    assert set(out.logprobs) == {0}
    assert set(out.sampled_token_ids) == {0, 1, 2, 3}
    lps = out.prompt_logprobs[0]
    assert len(lps) == len(tokens) - 1
    want = ref.log_softmax(-1)
    for t, entry in enumerate(lps):
        target = tokens[t + 1]
        assert abs(entry[target].logprob - want[t, target].item()) < 1e-4
    # a seeded sample repeats exactly when asked again (same seed, index and position)
    again = runner.execute(StepPlan(
        [SeqChunk(9, tokens, 0, (9,))],
        [new_seq(9, tokens, [6, 7, 8], sampled, index=1)], finished_seq_ids=[0, 1, 2, 3]))
    assert again.sampled_token_ids[9] == out.sampled_token_ids[2]


def test_block_copy_executes_before_forward(tiny_llama_dir, hf_model):
    runner = make_runner(tiny_llama_dir, 8)
    prompt = list(range(10, 30))  # 20 tokens: blocks 0, 1 full, block 2 holds 4 slots
    runner.forward(StepPlan([chunk(0, prompt, 0)], [new_seq(0, prompt, [0, 1, 2])]))
    # a fork writes into the shared partial block: copy it first, then decode into the copy;
    # the plan carries only the block id that changed
    logits = runner.forward(StepPlan([chunk(0, [77], 20)], block_table_updates=[(0, 2, [9])],
                                     block_copies=[(2, 9)]))
    assert runner.batch.seqs[0].block_table == [0, 1, 9]
    ref = dense_logits(hf_model, prompt + [77])[-1]
    torch.testing.assert_close(logits.sample[0], ref, atol=1e-4, rtol=1e-4)


def test_plans_that_contradict_the_kept_state_fail(tiny_llama_dir):
    runner = make_runner(tiny_llama_dir, 8)
    runner.forward(StepPlan([chunk(0, [5, 6, 7], 0)], [new_seq(0, [5, 6, 7], [0])]))
    with pytest.raises(ValueError, match="gap"):
        runner.forward(StepPlan([chunk(0, [8], 5)]))
    with pytest.raises(ValueError, match="differ"):
        runner.forward(StepPlan([chunk(0, [9], 1)]))
    with pytest.raises(ValueError, match="gap"):
        runner.forward(StepPlan(block_table_updates=[(0, 3, [4])]))
    runner.forward(StepPlan(finished_seq_ids=[0]))
    assert 0 not in runner.batch.seqs


@pytest.mark.parametrize("kernels", sorted(KERNELS))
def test_rope_scaling_and_tied_embeddings(tmp_path, kernels):
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    model_dir = build_tiny_llama(tmp_path, rope_scaling=scaling, tie_word_embeddings=True)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    runner = make_runner(model_dir, 16, kernels=kernels)
    tokens = list(range(3, 203))
    logits = runner.forward(StepPlan([chunk(0, tokens, 0)], [new_seq(0, tokens, list(range(13)))]))
    torch.testing.assert_close(logits.sample[0], dense_logits(hf, tokens)[-1], atol=1e-4,
                               rtol=1e-4)


def test_kernel_switches(tiny_llama_dir):
    from octavo.model.kernels.cpu_ops import select_cpu_ops
    from octavo.model.layers.linear import PackedLinear

    plain = make_runner(tiny_llama_dir, 16, kernels="torch")
    assert plain.model.norm.ops is None and plain.backend.name == "torch"
    assert not any(isinstance(m, PackedLinear) for m in plain.model.modules())
    with pytest.raises(ValueError, match="fused_ops='fast' is not one of"):
        select_cpu_ops("fused_ops", "fast", torch.device("cpu"))
