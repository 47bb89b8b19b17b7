"""Building StepPlans by hand for runner tests: sequences the runner has not seen come with
all their tokens and block table (NewSeq); chunks name them by id."""

from __future__ import annotations

import torch

from octavo.config import ModelConfig
from octavo.engine_args import EngineArgs
from octavo.model.worker.runner import ModelRunner
from octavo.sampling_params import SamplingParams
from octavo.step_plan import NewSeq, SeqChunk

GREEDY = SamplingParams(temperature=0, max_tokens=None)

# "compiled": oneDNN linears, the C++ decode kernel and fused ops (the CPU default);
# "torch": the plain-torch fallback of each
KERNELS = {"compiled": {}, "torch": dict(attention_backend="torch", linear_backend="torch",
                                         fused_ops="torch")}


def make_runner(model_dir, block_size: int, num_blocks: int = 200, kernels: str = "compiled",
                **options) -> ModelRunner:
    args = EngineArgs(block_size=block_size, max_model_len=512, **KERNELS[kernels], **options)
    runner = ModelRunner(args, model_dir, ModelConfig.from_dir(model_dir))
    runner.init_kv_cache(num_blocks)
    return runner


def new_seq(seq_id: int, tokens: list[int], table: list[int],
            params: SamplingParams = GREEDY, num_prompt_tokens: int | None = None,
            index: int = 0) -> NewSeq:
    n = len(tokens) if num_prompt_tokens is None else num_prompt_tokens
    return NewSeq(seq_id, list(tokens), n, index, params, list(table))


def chunk(seq_id: int, tokens: list[int], start: int, sample: bool = True,
          prompt_logprobs: bool = False) -> SeqChunk:
    return SeqChunk(seq_id, list(tokens), start, (seq_id,) if sample else (), prompt_logprobs)


def dense_logits(hf, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0]
