"""A reasoning budget: the token that closes a thinking section once it ran too long.

A row with `SamplingParams.thinking_token_budget` is in its reasoning when the last reasoning
marker of its tokens (prompt and output) is the start marker (`<think>`), whether the model
wrote it or the chat template opened it in the prompt. Once it has generated `budget` tokens
after that marker without writing the end marker, the end marker's tokens are forced one per
step (the next one after the part of it already written); then the row samples freely again.
Derived from the tokens alone, like every other sampling input: a preempted and recomputed
sequence, or a speculative position, gets the same answer.

Only the last `budget + len(start) + len(end)` tokens are searched: a reasoning section longer
than that would have been closed already.
"""

from __future__ import annotations

from collections.abc import Sequence

from octavo.sampling_params import SamplingParams


def _last(tokens: Sequence[int], marker: Sequence[int], lo: int) -> int:
    """Where the last occurrence of `marker` in tokens[lo:] starts, or -1."""
    n = len(marker)
    last = marker[-1]
    end = len(tokens)
    while end > lo:
        try:
            # the last `last` before `end`: list.index on the reversed window runs in C
            i = end - 1 - tokens[lo:end][::-1].index(last)
        except ValueError:
            return -1
        if i - n + 1 >= lo and list(tokens[i - n + 1:i + 1]) == list(marker):
            return i - n + 1
        end = i
    return -1


def forced_reasoning_token(params: SamplingParams, tokens: Sequence[int],
                           num_prompt_tokens: int) -> int | None:
    """The token the row must sample next to close its reasoning, or None."""
    budget = params.thinking_token_budget
    start, end = params.think_start_token_ids, params.think_end_token_ids
    if budget is None or not start or not end:
        return None
    lo = max(0, len(tokens) - budget - len(start) - len(end))
    opened = _last(tokens, start, lo)
    if opened < 0 or _last(tokens, end, opened + len(start)) >= 0:
        return None  # not thinking, or the reasoning was closed
    began = max(opened + len(start), num_prompt_tokens)
    written = len(tokens) - began  # reasoning tokens generated so far
    if written < budget:
        return None
    for k in range(min(len(end) - 1, written), 0, -1):  # the end marker's part written so far
        if list(tokens[len(tokens) - k:]) == list(end[:k]):
            return end[k]
    return end[0]
