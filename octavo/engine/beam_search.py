"""Beam search selection, compatible with transformers' `generate(num_beams=k, do_sample=False)`.

The engine keeps each live beam as a sequence; beams that continue from the same parent fork it
(copy-on-write shares every block), and a beam that is not continued is freed. This module only
decides: given the log-probabilities of every live beam's next token, which (parent, token)
pairs live on and which hypotheses are finished. The rules follow transformers: the top
``2 * beam_width`` candidates over all beams; candidates that end (EOS, or the length limit) and
rank among the first ``beam_width`` become finished hypotheses scored
``sum_logprobs / generated_len ** length_penalty``; the best ``beam_width`` others continue; the
search stops once the best running beam can no longer beat the worst of ``beam_width`` finished
hypotheses (transformers' ``early_stopping=False`` heuristic), or at the length limit.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from octavo.engine.sampling_params import BeamSearchParams

_NEG = -1.0e9


@dataclass(slots=True)
class BeamHypothesis:
    token_ids: list[int]  # generated tokens, EOS included when it ended the beam
    cum_logprob: float
    score: float  # cum_logprob / len ** length_penalty


@dataclass(slots=True)
class BeamSelection:
    parent: int  # index into the live beams passed to step()
    token_id: int
    cum_logprob: float


@dataclass
class BeamSearchState:
    params: BeamSearchParams
    eos_token_id: int | None
    running_scores: list[float] = field(default_factory=lambda: [0.0])
    finished: list[BeamHypothesis] = field(default_factory=list)
    num_generated: int = 0
    improvement_possible: bool = True
    done: bool = False

    def step(self, logprobs: torch.Tensor, outputs: list[list[int]]) -> list[BeamSelection]:
        """logprobs: [num_live_beams, vocab] log-softmax of each live beam's next-token logits;
        outputs: each live beam's generated tokens so far. Returns the next live beams."""
        k = self.params.beam_width
        num_beams, vocab = logprobs.shape
        scores = torch.tensor(self.running_scores, dtype=torch.float32, device=logprobs.device)
        acc = (logprobs.float() + scores[:, None]).reshape(-1)
        top_scores, top_idx = torch.topk(acc, k=min(2 * k, acc.numel()))
        top_scores, top_idx = top_scores.tolist(), top_idx.tolist()
        gen_len = self.num_generated + 1
        at_limit = gen_len >= self.params.max_tokens
        eos = None if self.params.ignore_eos else self.eos_token_id

        selections: list[BeamSelection] = []
        new_finished: list[BeamHypothesis] = []
        all_hit = True
        for rank, (score, idx) in enumerate(zip(top_scores, top_idx, strict=True)):
            parent, token = divmod(idx, vocab)
            hit = at_limit or token == eos
            all_hit &= hit
            if not hit:
                if len(selections) < k:
                    selections.append(BeamSelection(parent, token, score))
            elif rank < k and self.improvement_possible:
                new_finished.append(BeamHypothesis(
                    outputs[parent] + [token], score, score / gen_len**self.params.length_penalty
                ))
        merged = self.finished + new_finished
        merged.sort(key=lambda h: h.score, reverse=True)  # stable: earlier hypotheses win ties
        self.finished = merged[:k]
        self.running_scores = [s.cum_logprob for s in selections]
        self.num_generated = gen_len

        if len(self.finished) == k and self.improvement_possible:
            best_running = self.running_scores[0] if selections else _NEG
            best_possible = best_running / self.num_generated**self.params.length_penalty
            self.improvement_possible = best_possible > self.finished[-1].score
        self.done = all_hit or not self.improvement_possible or not selections
        return [] if self.done else selections
