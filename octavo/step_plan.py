"""The contract between the scheduler and the model runner: what one step computes.

Pure Python (no torch): the engine builds it from its sequences and the KV manager's block tables;
the runner turns it into tensors. The model never sees a request.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class SeqChunk:
    """New tokens of one sequence computed in this step.

    Tokens ``token_ids`` sit at positions ``start_pos .. start_pos + len(token_ids) - 1``; the
    first ``start_pos`` tokens' K/V are already in the blocks of ``block_table`` (a prefix-cache
    hit, an earlier chunk of the prompt, or earlier decode steps).
    """

    token_ids: list[int]
    start_pos: int
    block_table: list[int]
    # Logits for the last token of the chunk: the sequence samples after this step.
    sample: bool = True
    # Logits for every token of the chunk (prompt logprobs); implies nothing about `sample`.
    all_logits: bool = False

    @property
    def context_len(self) -> int:
        return self.start_pos + len(self.token_ids)


@dataclass(slots=True)
class StepPlan:
    chunks: list[SeqChunk]
    # Copy-on-write copies (src, dst physical block ids), executed before the forward.
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    # Swap traffic: (device block, host block) out, (host block, device block) in; both executed
    # before the forward (swap-out before block copies, swap-in after, so freed blocks can be
    # reused in the same step).
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)
