"""Custom logits processors (vLLM v1's interface): built once, told the batch's changes, and
applied to every sampling row; per-request arguments through SamplingParams.extra_args."""

from __future__ import annotations

import pytest
import torch

from octavo.llm import LLM
from octavo.model.sample.logits_processor import (
    BatchUpdate,
    LogitsProcessor,
    resolve_processor_class,
)
from octavo.sampling_params import SamplingParams


class TargetToken(LogitsProcessor):
    """vLLM's example: a request with extra_args {"target_token": t} always samples t."""

    instances: list[TargetToken] = []

    def __init__(self, engine_args, device, is_pin_memory) -> None:
        self.targets: dict[int, int] = {}
        self.updates: list[BatchUpdate | None] = []
        TargetToken.instances.append(self)

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        self.updates.append(batch_update)
        if batch_update is None:
            return
        for index, params, _, _ in batch_update.added:
            target = (params.extra_args or {}).get("target_token")
            if target is None:
                self.targets.pop(index, None)
            else:
                self.targets[index] = target
        for index in batch_update.removed:
            self.targets.pop(index, None)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for row, target in self.targets.items():
            value = logits[row, target].item()
            logits[row] = float("-inf")
            logits[row, target] = value
        return logits


@pytest.fixture(scope="module")
def llm(tiny_llama_dir) -> LLM:
    TargetToken.instances.clear()
    return LLM(model=str(tiny_llama_dir), num_kv_blocks=256, logits_processors=[TargetToken])


def test_targeted_requests_sample_their_token_and_others_are_untouched(llm: LLM) -> None:
    plain = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    baseline = llm.generate(["abc"], plain)[0].outputs[0].token_ids
    forced = SamplingParams(temperature=1.0, seed=1, max_tokens=6, ignore_eos=True,
                            extra_args={"target_token": 77})
    outs = llm.generate(["abc", "xyz", "abc"], [plain, forced, plain])
    assert outs[1].outputs[0].token_ids == [77] * 6
    assert outs[0].outputs[0].token_ids == baseline
    assert outs[2].outputs[0].token_ids == baseline
    assert len(TargetToken.instances) == 1  # built once by the runner


def test_added_rows_carry_params_and_live_output_lists(llm: LLM) -> None:
    proc = TargetToken.instances[0]
    proc.updates.clear()
    llm.generate(["hello"], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True,
                                           extra_args={"target_token": 5}))
    first = proc.updates[0]
    assert first is not None and first.batch_size == 1
    index, params, prompt, output = first.added[0]
    assert index == 0 and params.extra_args == {"target_token": 5} and len(prompt) == 5
    # the same list object grew as tokens were sampled; later steps added nothing new
    assert output == [5, 5, 5, 5]
    assert all(u is None for u in proc.updates[1:])


def test_processor_names_resolve_and_bad_ones_are_refused() -> None:
    assert resolve_processor_class(f"{__name__}:TargetToken") is TargetToken
    assert resolve_processor_class(f"{__name__}.TargetToken") is TargetToken
    with pytest.raises(ValueError, match="cannot import"):
        resolve_processor_class("no.such.module:Thing")
    with pytest.raises(ValueError, match="not a subclass"):
        resolve_processor_class(dict)
