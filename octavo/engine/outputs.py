"""What the engine hands back: vLLM's RequestOutput / CompletionOutput shapes.

Outputs are cumulative (the whole text and token list so far), as vLLM's default; a streaming
server takes the delta itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Any]] | None
    finish_reason: str | None = None  # "stop", "length", "abort"
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[dict[int, Any] | None] | None
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
