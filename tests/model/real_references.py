"""The stored references of HF transformers on the real GGUF models (tests/fixtures/<model>.npz,
written by scripts/gguf_references.py): reading them, and measuring octavo's block path against
them teacher-forced."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


def fixture_path(model: str) -> Path:
    return FIXTURES / f"{model}.npz"


def load_fixture(model: str) -> dict:
    """meta (the prompts' texts and messages, versions), prompts (token ids), tokens
    (transformers' 64 greedy tokens each), top_ids / top_logprobs ([prompt, position, K])."""
    with np.load(fixture_path(model)) as f:
        data = {k: f[k] for k in f.files}
    off = data["prompt_offsets"]
    prompts = [data["prompt_ids"][off[i]:off[i + 1]].tolist() for i in range(len(off) - 1)]
    return {"meta": json.loads(str(data["meta"])), "prompts": prompts,
            "tokens": data["tokens"].tolist(), "top_ids": data["top_ids"],
            "top_logprobs": data["top_logprobs"].astype(np.float32)}


def teacher_forced(llm, ref: dict) -> tuple[float, torch.Tensor]:
    """octavo's top-1 agreement with transformers' greedy tokens when fed transformers' own
    sequences, and the KL divergence KL(transformers || octavo) at every generated position,
    over transformers' stored top K tokens and the rest of the vocabulary as one outcome (a
    lower bound of the full KL that approaches it as the top K hold the mass)."""
    from octavo.bench.quant import sequence_logits

    agree = total = 0
    kls = []
    for i, (p, r) in enumerate(zip(ref["prompts"], ref["tokens"], strict=True)):
        q = sequence_logits(llm, p + r)[len(p) - 1: len(p) + len(r) - 1].log_softmax(-1)
        agree += int((q.argmax(-1) == torch.tensor(r)).sum())
        total += len(r)
        p_top = torch.from_numpy(ref["top_logprobs"][i]).double()  # [positions, K]
        q_top = q.gather(1, torch.from_numpy(ref["top_ids"][i]).long()).double()
        p_rest = (1 - p_top.exp().sum(-1)).clamp_min(1e-12)
        q_rest = (1 - q_top.exp().sum(-1)).clamp_min(1e-12)
        kl = (p_top.exp() * (p_top - q_top)).sum(-1) + p_rest * (p_rest.log() - q_rest.log())
        kls.append(kl)
    return agree / total, torch.cat(kls)
