"""Request and sequence state.

A request holds one sequence while its prompt is computed; with ``n > 1`` it forks into ``n``
sequences that share the prompt's blocks (copy-on-write). A sequence's progress is one number,
``num_computed_tokens``, catching up with ``len(token_ids)``: that single mechanism covers
prefill, chunked prefill, prefix-cache hits, decode and recompute after preemption.
"""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field
from typing import Any

from octavo.engine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"


_seq_ids = itertools.count()


@dataclass(eq=False)
class Sequence:
    request: Request
    token_ids: list[int]
    num_prompt_tokens: int
    index: int = 0  # position among the request's n outputs
    seq_id: int = field(default_factory=lambda: next(_seq_ids))
    num_computed_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    cumulative_logprob: float = 0.0
    logprobs: list[Any] | None = None  # per generated token, when asked
    detokenizer: Any = None
    output_text: str = ""
    # beam search: this beam's next-token log-probs, kept until every live beam has them
    pending_logprobs: Any = None

    @property
    def num_new_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(eq=False)
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_index: int
    priority: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    status: RequestStatus = RequestStatus.WAITING
    seqs: list[Sequence] = field(default_factory=list)
    prompt_logprobs: list[Any] | None = None
    cache_salt: str | None = None
    beam: Any = None  # BeamSearchState for beam-search requests
    # metrics
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0

    def __post_init__(self) -> None:
        if not self.seqs:
            self.seqs = [Sequence(self, list(self.prompt_token_ids), len(self.prompt_token_ids))]

    @property
    def live_seqs(self) -> list[Sequence]:
        return [s for s in self.seqs if not s.is_finished]

    @property
    def is_finished(self) -> bool:
        if self.status is RequestStatus.FINISHED:
            return True
        if self.beam is not None:
            return self.beam.done
        return all(s.is_finished for s in self.seqs) and len(self.seqs) == self.params.n

    @property
    def max_seqs(self) -> int:
        """Sequences this request may run at once (n samples, or beam_width beams)."""
        return self.beam.params.beam_width if self.beam is not None else self.params.n

    @property
    def sort_key(self) -> tuple[int, int]:
        return (self.priority, self.arrival_index)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)
