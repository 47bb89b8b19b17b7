"""Engine logprobs (per position: {token_id: Logprob(logprob, rank)}) in OpenAI's two shapes.

Completions use the legacy parallel lists (tokens / token_logprobs / top_logprobs /
text_offset); chat uses a list of {token, logprob, bytes, top_logprobs}. JSON has no -inf, so
impossible tokens are reported as -9999.0, as vLLM does.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from octavo.server.context import ServerContext
from octavo.server.protocol import (
    ChatChoiceLogprobs,
    ChatTokenLogprob,
    ChatTopLogprob,
    CompletionLogprobs,
)

PositionLogprobs = dict[int, Any]  # token id -> Logprob


def _finite(x: float) -> float:
    return x if math.isfinite(x) else -9999.0


def completion_logprobs(
    ctx: ServerContext, token_ids: Sequence[int],
    positions: Sequence[PositionLogprobs | None], text_offset: int,
) -> CompletionLogprobs:
    """Legacy logprobs for `token_ids`; a None position (first prompt token) has no logprob."""
    out = CompletionLogprobs()
    offset = text_offset
    for tid, pos in zip(token_ids, positions, strict=False):
        s = ctx.token_str(tid)
        out.tokens.append(s)
        out.text_offset.append(offset)
        offset += len(s)
        if pos is None:
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            continue
        out.token_logprobs.append(_finite(pos[tid].logprob) if tid in pos else None)
        out.top_logprobs.append(
            {ctx.token_str(t): _finite(lp.logprob) for t, lp in pos.items()}
        )
    return out


def chat_logprobs(
    ctx: ServerContext, token_ids: Sequence[int], positions: Sequence[PositionLogprobs],
    top_k: int,
) -> ChatChoiceLogprobs:
    content = []
    for tid, pos in zip(token_ids, positions, strict=False):
        s = ctx.token_str(tid)
        tops = sorted(
            ((t, lp) for t, lp in pos.items() if lp.rank is not None and lp.rank <= top_k),
            key=lambda item: item[1].rank,
        )
        content.append(ChatTokenLogprob(
            token=s, logprob=_finite(pos[tid].logprob), bytes=list(s.encode()),
            top_logprobs=[
                ChatTopLogprob(token=ctx.token_str(t), logprob=_finite(lp.logprob),
                               bytes=list(ctx.token_str(t).encode()))
                for t, lp in tops
            ],
        ))
    return ChatChoiceLogprobs(content=content)
