"""Fixtures for the engine tests: the HF reference model (fp32) and helpers around it."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

# The test machines are small and shared: torch's OpenMP threads spin against other processes
# and a decode step can get 30x slower. One thread is predictable; override to measure.
TORCH_THREADS = int(os.environ.get("OCTAVO_TEST_TORCH_THREADS", "1"))


@pytest.fixture(scope="package", autouse=True)
def _torch_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(TORCH_THREADS)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def hf_model(default_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()
    # ignore_eos: generate must neither stop at EOS nor suppress it
    model.generation_config.eos_token_id = None
    return model


def hf_greedy(model, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """HF transformers' greedy continuation of each prompt, one by one (no padding)."""
    refs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            out = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                do_sample=False, pad_token_id=0,
            )
            refs.append(out[0, len(p):].tolist())
    return refs


def hf_log_softmax(model, token_ids: list[int]) -> torch.Tensor:
    """[len(token_ids), vocab] log-probabilities of the next token at every position."""
    with torch.no_grad():
        logits = model(torch.tensor([token_ids])).logits[0]
    return logits.to(torch.float32).log_softmax(dim=-1)


def tokens_prompt(ids: list[int]) -> dict:
    return {"prompt_token_ids": list(ids)}
