"""What the engine hands back: vLLM's RequestOutput / CompletionOutput / Logprob shapes.

Outputs are cumulative (the whole text and token list so far), as vLLM's default; a streaming
server takes the delta itself. A neutral module: every layer may import it (the runner builds
Logprobs, the engine RequestOutputs, the server reads both).
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
