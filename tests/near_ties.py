"""An engine's greedy tokens against HF transformers' where the two may round differently.

On CPU every kernel path gives HF's fp32 tokens exactly, and the tests demand that (`exact`).
On a GPU, cuBLAS and the Triton kernels sum the fused GEMMs and attention in another order than
HF's run, so two logits within rounding of each other may come out in either order: greedy
decoding then takes the other token, and the continuation differs from there on. That is
accepted only at a recorded near-tie, where HF's own top-2 logprob gap at the first differing
position is below NEAR_TIE; a divergence anywhere else fails. Up to that position every chosen
token's logprob must be within LOGPROB_ATOL of HF's.

The bounds are for fp32 weights and activations on both sides: fp32 rounding (2^-24 relative)
summed over a few thousand terms per dot product and through the layers moves a logprob by
1e-5 to 1e-4 on the models the tests use; a wrong mask, scale, slot or block read moves it by
far more than 1e-3. In bf16 (8 bits of mantissa: one rounding moves a logit of 10 by 0.04)
the bounds are BF16_NEAR_TIE and BF16_LOGPROB_ATOL.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

NEAR_TIE = 1e-3  # HF top-2 logprob gap under which either token may win
LOGPROB_ATOL = 1e-3  # |engine - HF| logprob of each chosen token before any divergence
BF16_NEAR_TIE = 0.1
BF16_LOGPROB_ATOL = 0.1


@dataclass
class HFReference:
    """HF's greedy continuation of each prompt, with, at each generated position, its top-1
    minus top-2 logprob gap and the logprob of the token it chose."""

    tokens: list[list[int]]
    gaps: list[list[float]]
    logprobs: list[list[float]]

    def head(self, n: int) -> HFReference:
        """The first n generated positions of each prompt."""
        return HFReference([t[:n] for t in self.tokens], [g[:n] for g in self.gaps],
                           [lp[:n] for lp in self.logprobs])

    def pick(self, rows: list[int]) -> HFReference:
        return HFReference([self.tokens[i] for i in rows], [self.gaps[i] for i in rows],
                           [self.logprobs[i] for i in rows])


@torch.no_grad()
def hf_reference(model, prompts: list[list[int]], max_new_tokens: int) -> HFReference:
    """HF transformers' greedy continuation of each prompt, one by one (no padding), on the
    model's device."""
    model.generation_config.eos_token_id = None
    device = next(model.parameters()).device
    ref = HFReference([], [], [])
    for p in prompts:
        ids = torch.tensor([p], device=device)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=max_new_tokens, pad_token_id=0,
                             output_logits=True, return_dict_in_generate=True)
        tokens = out.sequences[0, len(p):]
        lp = torch.stack(out.logits)[:, 0].float().log_softmax(-1)  # [steps, vocab]
        top2 = lp.topk(2, dim=-1).values
        ref.tokens.append(tokens.tolist())
        ref.gaps.append((top2[:, 0] - top2[:, 1]).tolist())
        ref.logprobs.append(lp.gather(1, tokens[:, None])[:, 0].tolist())
    return ref


def hf_reference_from_dir(path, prompts: list[list[int]], max_new_tokens: int,
                          **load) -> HFReference:
    """hf_reference of the HF model saved at `path`, in fp32 on CPU (`load`: from_pretrained
    options)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **load).eval()
    return hf_reference(model, prompts, max_new_tokens)


def chosen_logprobs(output) -> list[float] | None:
    """The logprob of each token a CompletionOutput chose (SamplingParams(logprobs=0))."""
    if output.logprobs is None:
        return None
    return [pos[t].logprob for pos, t in zip(output.logprobs, output.token_ids, strict=True)]


def check_greedy(got: list[list[int]], ref: HFReference, exact: bool,
                 got_logprobs: list[list[float] | None] | None = None,
                 near_tie: float = NEAR_TIE, atol: float = LOGPROB_ATOL
                 ) -> list[tuple[int, int, float]]:
    """Assert that each prompt's tokens `got` are HF's (`exact`), or HF's up to a recorded
    near-tie (a top-2 gap below `near_tie`; see the module doc), with logprobs within `atol`
    until then. Returns the near-ties where a prompt diverged: (prompt, position, HF's gap)."""
    ties = []
    for i, (tokens, want) in enumerate(zip(got, ref.tokens, strict=True)):
        assert len(tokens) == len(want), f"prompt {i}: {len(tokens)} tokens, HF {len(want)}"
        first = next((j for j, (a, b) in enumerate(zip(tokens, want, strict=True)) if a != b),
                     None)
        if first is not None:
            gap = ref.gaps[i][first]
            assert not exact, f"prompt {i}: token {first} is {tokens[first]}, HF {want[first]}"
            assert gap < near_tie, (
                f"prompt {i}: token {first} is {tokens[first]}, HF {want[first]}, and HF's "
                f"top-2 gap there is {gap:.2e} (a near-tie is < {near_tie})")
            ties.append((i, first, gap))
        lps = got_logprobs[i] if got_logprobs is not None else None
        if lps is not None:
            end = len(tokens) if first is None else first
            worst = max((abs(a - b) for a, b in zip(lps[:end], ref.logprobs[i][:end],
                                                       strict=True)), default=0.0)
            assert worst <= atol, (
                f"prompt {i}: a chosen token's logprob is {worst:.2e} off HF's (bound {atol})")
    return ties
