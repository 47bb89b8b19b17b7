"""Which draft tokens a speculative step keeps.

The runner samples a token at the position of the last known token and after each draft token,
each as a plain decode would at that position (same processing, same seeded draw). Draft token
j + 1 is kept when the sample at position j equals it; the first sample that differs, or the
one after the last draft, ends the step's tokens. For a deterministic draft (n-gram prompt
lookup proposes one token per position, with probability 1) this is exactly rejection sampling:
the draft d is accepted with probability p(d) and otherwise the token comes from p with d
removed, renormalised, so every emitted token has the target distribution p. With temperature
0 it is greedy acceptance: the output is the one plain greedy decoding produces.
"""

from __future__ import annotations

from collections.abc import Sequence


def accept_drafts(drafts: Sequence[int], samples: Sequence[int]) -> list[int]:
    """The tokens a step emits: the leading drafts each agreeing with the sample before them,
    then one more sample. `samples[j]` was drawn at the position after drafts[:j]."""
    if len(samples) != len(drafts) + 1:
        raise ValueError(f"{len(samples)} samples for {len(drafts)} drafts")
    kept: list[int] = []
    for draft, sample in zip(drafts, samples, strict=False):
        kept.append(sample)
        if sample != draft:
            return kept
    kept.append(samples[len(drafts)])
    return kept
