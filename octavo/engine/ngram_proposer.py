"""N-gram (prompt lookup) proposals for speculative decoding.

The draft for a sequence is what followed the latest earlier occurrence of its last n tokens,
trying the longest n first (vLLM's `ngram` method, after prompt lookup decoding). It costs no
model call: answers that copy spans of their input (edits, extraction, code, quoting) get long
drafts that are usually right, free text gets few drafts.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def propose_ngram(token_ids: Sequence[int], k: int, n_min: int, n_max: int) -> list[int]:
    """Up to `k` tokens that followed the latest earlier occurrence of the last n tokens of
    `token_ids`, for the largest n in [n_min, n_max] that occurs; [] when none does."""
    length = len(token_ids)
    if k < 1 or length < n_min + 1:
        return []
    tokens = np.asarray(token_ids, dtype=np.int64)
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        tail = tokens[length - n :]
        # windows that start at i <= length - n - 1: each has at least one token after it,
        # and the tail itself (i = length - n) is not among them
        candidates = np.flatnonzero(tokens[: length - n] == tail[0])
        if candidates.size and n > 1:
            windows = sliding_window_view(tokens[: length - 1], n)
            candidates = candidates[(windows[candidates] == tail).all(axis=1)]
        if candidates.size:
            start = int(candidates[-1]) + n
            return tokens[start : start + k].tolist()
    return []
