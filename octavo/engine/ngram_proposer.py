"""N-gram (prompt lookup) proposals for speculative decoding.

The draft for a sequence is what followed the latest earlier occurrence of its last n tokens,
trying the longest n first (vLLM's `ngram` method, after prompt lookup decoding); where that
occurrence is closer to the end than k tokens, the copy runs on into itself, so a repeating
pattern is continued for all k tokens. It costs no
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
            # copy what followed; a match close to the end copies on into its own copy
            # (an overlapping copy, as in LZ77), which continues a repeating pattern
            start = int(candidates[-1]) + n
            draft = tokens[start : start + k].tolist()
            period = length - start
            while len(draft) < k:
                draft.append(draft[len(draft) - period])
            return draft
    return []
