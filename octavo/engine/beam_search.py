"""Beam search, compatible with transformers' `generate(num_beams=k, do_sample=False)`.

Each live beam is a sequence. The runner gives every beam the log-probabilities of its top
``2 * beam_width`` next tokens (the only candidates that can rank in the top ``2 * beam_width``
over all beams); `BeamSearchState.step` picks the next beams from them, and `advance` applies
the pick to the sequences: a beam continued twice forks (copy-on-write shares every block), one
not continued is freed.

The rules follow transformers: the top ``2 * beam_width`` candidates over all beams, scored in
float32 as transformers does; candidates that end (EOS, or the length limit) and rank among the
first ``beam_width`` become finished hypotheses scored ``sum_logprobs / generated_len **
length_penalty``; the best ``beam_width`` others continue; the search stops once the best
running beam can no longer beat the worst of ``beam_width`` finished hypotheses (transformers'
``early_stopping=False`` heuristic), or at the length limit.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field

from octavo.engine.request import Request, Sequence
from octavo.outputs import PositionLogprobs
from octavo.paging.allocator import KVAllocator
from octavo.sampling_params import BeamSearchParams, SamplingParams

_NEG = -1.0e9


def _f32(x: float) -> float:
    return array("f", [x])[0]


def beam_sampling_params(params: BeamSearchParams) -> SamplingParams:
    """What each beam asks of the runner: greedy rows with their top 2k logprobs (beams are
    chosen here, EOS and length too)."""
    return SamplingParams(temperature=0, max_tokens=params.max_tokens, ignore_eos=True,
                          detokenize=False, logprobs=2 * params.beam_width)


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
    # seq_id -> this step's next-token logprobs, kept until every live beam has them
    pending: dict[int, PositionLogprobs] = field(default_factory=dict)

    def step(
        self, logprobs: list[PositionLogprobs], outputs: list[list[int]]
    ) -> list[BeamSelection]:
        """logprobs: per live beam, its top next-token log-probabilities (ranks 1..2k at least);
        outputs: each live beam's generated tokens so far. Returns the next live beams."""
        k = self.params.beam_width
        candidates = [
            (_f32(score + lp.logprob), parent, token)
            for parent, (score, row) in enumerate(zip(self.running_scores, logprobs, strict=True))
            for token, lp in row.items()
            if lp.rank is not None and lp.rank <= 2 * k
        ]
        candidates.sort(key=lambda c: (-c[0], c[1], c[2]))
        gen_len = self.num_generated + 1
        at_limit = gen_len >= self.params.max_tokens
        eos = None if self.params.ignore_eos else self.eos_token_id

        selections: list[BeamSelection] = []
        new_finished: list[BeamHypothesis] = []
        all_hit = True
        for rank, (score, parent, token) in enumerate(candidates[: 2 * k]):
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


def advance(request: Request, kv: KVAllocator) -> tuple[list[Sequence], list[Sequence]]:
    """One beam step for a request whose live beams all have their pending logprobs: fork the
    beams continued more than once, free those not continued, append each beam's token.
    Returns (the forked beams, the freed beams); nothing changes once the search is done."""
    state = request.beam
    assert state is not None
    beams = request.seqs
    logprobs = [state.pending.pop(b.seq_id) for b in beams]
    selections = state.step(logprobs, [b.output_token_ids for b in beams])
    if state.done:
        return [], []
    continued: set[int] = set()
    born: list[Sequence] = []
    next_beams: list[tuple[Sequence, int]] = []
    for sel in selections:  # fork from the parents' current state before any token lands
        parent = beams[sel.parent]
        if sel.parent in continued:
            seq = parent.fork()
            kv.fork(parent.seq_id, seq)
            born.append(seq)
        else:
            continued.add(sel.parent)
            seq = parent
        next_beams.append((seq, sel.token_id))
    died = [b for i, b in enumerate(beams) if i not in continued]
    for beam in died:
        kv.free(beam.seq_id)  # a beam that dies frees its own blocks
    for index, (seq, token) in enumerate(next_beams):
        seq.append_token(token)
        seq.index = index
    request.seqs = [seq for seq, _ in next_beams]
    return born, died
