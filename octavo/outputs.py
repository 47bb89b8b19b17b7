"""What the engine hands back: vLLM's RequestOutput / CompletionOutput / Logprob shapes.

Outputs are cumulative (the whole text and token list so far) by default, as in vLLM; a
request whose SamplingParams ask for `RequestOutputKind.DELTA` gets only what is new in each
output, and `RequestOutput.add` merges two such deltas (a stream whose reader lags). A neutral
module: every layer may import it (the runner builds Logprobs, the engine RequestOutputs, the
server reads both).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """Logprob of one token at one position; rank 1 is the most likely token."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One position's logprobs: the top-k tokens in descending order (ranks 1..k), then the
# chosen token if it was not among them.
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[PositionLogprobs] | None
    finish_reason: str | None = None  # "stop", "length", "abort"
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[PositionLogprobs | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: dict[str, float | None] = field(default_factory=dict)

    def add(self, later: RequestOutput) -> None:
        """Merge a later DELTA output of the same request into this one (in place): texts,
        token ids and logprobs appended per sequence, the rest taken from `later`."""
        mine = {o.index: o for o in self.outputs}
        for o in later.outputs:
            have = mine.get(o.index)
            if have is None:
                self.outputs.append(o)
                mine[o.index] = o
                continue
            have.text += o.text
            have.token_ids = have.token_ids + o.token_ids
            if o.logprobs is not None:
                have.logprobs = (have.logprobs or []) + o.logprobs
            have.cumulative_logprob = o.cumulative_logprob
            have.finish_reason, have.stop_reason = o.finish_reason, o.stop_reason
        self.outputs.sort(key=lambda o: o.index)
        self.prompt_logprobs = later.prompt_logprobs
        self.finished = later.finished
        self.num_cached_tokens = later.num_cached_tokens
        self.metrics = later.metrics


@dataclass(slots=True)
class RequestProgress:
    """A request a step touched, whatever its output kind: its timestamps (RequestOutput's
    `metrics` keys) and whether it finished. What metrics observe; carries no tokens."""

    request_id: str
    metrics: dict[str, float | None]
    finished: bool
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0  # so far, over all its sequences


@dataclass
class BeamSearchSequence:
    """One finished beam: `tokens` holds the prompt and the generated tokens."""

    tokens: list[int]
    cum_logprob: float
    text: str
    finish_reason: str | None = None


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]
