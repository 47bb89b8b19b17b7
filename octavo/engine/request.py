"""Request and sequence state, and what one step changed about them.

A request holds one sequence while its prompt is computed; with ``n > 1`` it forks into ``n``
sequences that share the prompt's blocks (copy-on-write). A sequence's progress is one number,
``num_computed_tokens`` (see paging/kv_seq.py), catching up with ``len(token_ids)``: that
single mechanism covers prefill, chunked prefill, prefix-cache hits, decode and recompute after
preemption. The scheduler owns this state; the output processor reads it.
"""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from octavo.engine.speculator import DraftState
from octavo.outputs import PositionLogprobs
from octavo.paging.block_hash import BlockHasher
from octavo.paging.kv_seq import KVSeq
from octavo.sampling_params import BeamSearchParams, SamplingParams


class BeamState(Protocol):
    """What a request needs of its beam search (engine/beam_search.py: BeamSearchState)."""

    params: BeamSearchParams
    eos_token_id: int | None
    done: bool
    pending: dict[int, PositionLogprobs]  # seq_id -> logprobs of this step, until all have them
    finished: list  # BeamHypothesis, best first


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"


_seq_ids = itertools.count()


class Sequence(KVSeq):
    __slots__ = ("request", "num_prompt_tokens", "index", "finish_reason", "stop_reason",
                 "in_runner", "grammar", "draft")

    def __init__(self, request: Request, token_ids: list[int], num_prompt_tokens: int, *,
                 index: int = 0, block_hashes: list[bytes] | None = None,
                 num_computed_tokens: int = 0) -> None:
        super().__init__(next(_seq_ids), token_ids, hasher=request.hasher,
                         extra_key=request.cache_salt, block_hashes=block_hashes,
                         num_computed_tokens=num_computed_tokens)
        self.request = request
        self.num_prompt_tokens = num_prompt_tokens
        self.index = index  # position among the request's n outputs (or beams)
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        # whether the runner holds this sequence's state (it drops it when the sequence is
        # freed, preempted or swapped out, and is sent it again when it is scheduled again)
        self.in_runner = False
        # structured outputs: the grammar matcher (llguidance.LLMatcher) of this sequence's
        # output tokens; None when unconstrained
        self.grammar: Any = None
        # speculative decoding: its acceptance record (engine/speculator.py: DraftState)
        self.draft: DraftState | None = None

    def fork(self, index: int | None = None) -> Sequence:
        """A new sequence with this one's tokens, block hashes and computed tokens; the KV
        manager's fork gives it the blocks."""
        child = Sequence(self.request, list(self.token_ids), self.num_prompt_tokens,
                         index=self.index if index is None else index,
                         block_hashes=list(self.block_hashes),
                         num_computed_tokens=self.num_computed_tokens)
        if self.grammar is not None:
            child.grammar = self.grammar.deep_copy()
        return child

    def drop_last_tokens(self, n: int) -> None:
        """Forget the last `n` output tokens of a sequence a stop string ended before them
        (a step of several tokens); it is freed right after, so its blocks need no change."""
        if not 0 <= n <= self.num_output_tokens:
            raise ValueError(f"cannot drop {n} of {self.num_output_tokens} output tokens")
        if n:
            del self.token_ids[len(self.token_ids) - n :]

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
    cache_salt: str | None = None
    eos_token_id: int | None = None
    beam: BeamState | None = None
    hasher: BlockHasher | None = None  # names full blocks for the prefix cache
    # metrics
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0
    # prompt tokens found in the prefix cache when it was first scheduled
    num_cached_tokens: int | None = None

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


@dataclass(slots=True)
class SeqUpdate:
    """Tokens a sequence gained in one step (the scheduler already checked EOS, stop token ids
    and length; a sequence they finished is freed)."""

    seq: Sequence
    new_token_ids: list[int]
    new_logprobs: list[PositionLogprobs] | None = None


@dataclass(slots=True)
class RequestUpdate:
    """What one step changed about a request, for the output processor."""

    request: Request
    seqs: list[SeqUpdate] = field(default_factory=list)
    # (start position of the chunk, logprobs of the prompt tokens it predicted)
    prompt_logprobs: tuple[int, list[PositionLogprobs]] | None = None
    beam_step: bool = False  # its beams advanced by one token
