"""The contract between the scheduler and the model runner: what one step computes, and what
comes back.

Pure Python (no torch), sequences named only by id. The runner keeps what it knows of each
sequence between steps (its tokens, block table and sampling settings), so a plan carries only
what changed: sequences it has not seen, new block ids, the tokens to compute, and which
sequences to forget. The model never sees a request.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field

from octavo.outputs import PositionLogprobs
from octavo.sampling_params import SamplingParams


@dataclass(slots=True)
class NewSeq:
    """A sequence the runner has not seen: new, forked, or back from preemption."""

    seq_id: int
    token_ids: list[int]  # every known token: the prompt and any outputs so far
    num_prompt_tokens: int
    index: int  # position among its request's n outputs (it picks the seeded draws)
    params: SamplingParams
    block_ids: list[int]  # its whole block table (of KV cache group 0)
    # the block tables of groups 1, 2, ... where local and global layers keep separate ones
    group_block_ids: list[list[int]] = field(default_factory=list)


@dataclass(slots=True)
class SeqChunk:
    """New tokens of one sequence computed in this step.

    Tokens ``token_ids`` sit at positions ``start_pos .. start_pos + len(token_ids) - 1``; the
    first ``start_pos`` tokens' K/V are already in the sequence's blocks (a prefix-cache hit, an
    earlier chunk of the prompt, or earlier decode steps).
    """

    seq_id: int
    token_ids: list[int]
    start_pos: int
    # Sequences that sample their next token from the logits of this chunk's last token: the
    # sequence itself once it has caught up with its tokens, plus the n - 1 samples forked from
    # it when its prompt completes; empty while a prompt is still being chunked.
    sample_seq_ids: tuple[int, ...] = ()
    # Logprobs of the prompt tokens this chunk predicts (SamplingParams.prompt_logprobs).
    prompt_logprobs: bool = False
    # Speculative decoding: `num_draft_tokens` tokens proposed to follow `token_ids` (a decode
    # of one known token that samples only itself), computed after it at the lookahead slots
    # the KV manager handed out. The scheduler's proposer (n-gram) gives them in
    # `draft_token_ids`; where a model drafts, the runner proposes them itself (the
    # scheduler needs only how many it kept: the tokens it gets). The runner samples at each
    # position and keeps the longest run of drafts its samples agree with, plus the first
    # sample that disagrees (or the one past them).
    draft_token_ids: list[int] = field(default_factory=list)
    num_draft_tokens: int = 0

    @property
    def context_len(self) -> int:
        """Positions whose K/V exist after this chunk's known tokens (drafts not counted)."""
        return self.start_pos + len(self.token_ids)

    @property
    def num_query_tokens(self) -> int:
        """Tokens the forward pass computes for this chunk: the known ones and the drafts."""
        return len(self.token_ids) + self.num_draft_tokens


@dataclass(slots=True)
class GrammarBitmask:
    """Tokens each constrained sequence may sample this step (structured outputs).

    `pending` resolves (on the engine's grammar thread, while the forward pass runs) to a
    uint8 array [len(seq_ids), vocab]: entry [r, t] is 1 when token t is allowed for sequence
    seq_ids[r] at draft position positions[r] (0: the next token; j: after its chunk's first
    j draft tokens).
    """

    seq_ids: list[int]
    pending: Future
    positions: list[int] = field(default_factory=list)  # empty: all 0


@dataclass(slots=True)
class StepPlan:
    chunks: list[SeqChunk] = field(default_factory=list)
    new_seqs: list[NewSeq] = field(default_factory=list)
    # (seq_id, start, block ids): the sequence's block table reads these ids from entry `start`
    # on (appended blocks, or a copy-on-write copy replacing a shared block).
    block_table_updates: list[tuple[int, int, list[int]]] = field(default_factory=list)
    # (seq_id, group, start, block ids): the same for KV cache groups 1, 2, ... (hybrid models)
    group_table_updates: list[tuple[int, int, int, list[int]]] = field(default_factory=list)
    # Sequences to forget before anything else (finished, aborted, preempted); one may come
    # back in new_seqs of the same plan.
    finished_seq_ids: list[int] = field(default_factory=list)
    # Copy-on-write copies (src, dst physical block ids), executed before the forward.
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    # Swap traffic: (device block, host block) out, (host block, device block) in; both executed
    # before the forward (swap-out before block copies, swap-in after, so freed blocks can be
    # reused in the same step).
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    # Models with recurrent layers (paging/state_slots.py): state-slot transfers, executed
    # before the forward in this order, each (kind, source slot, destination slot) with kind
    # "copy" (device to device), "out" (device to host) or "in" (host to device); and the
    # snapshots (seq_id, position, slot): during the forward, the sequence's state after
    # `position` tokens (a block boundary inside its chunk) is also written into `slot`.
    state_transfers: list[tuple[str, int, int]] = field(default_factory=list)
    state_snapshots: list[tuple[int, int, int]] = field(default_factory=list)
    # The KV tier (paging/tier/): blocks whose bytes the runner copies out first of all, before
    # anything this step writes over them (returned in RunnerOutput.saved_blocks, in this
    # order), and (block id, bytes) loaded into fresh blocks after the swaps, before the forward.
    tier_saves: list[int] = field(default_factory=list)
    tier_loads: list[tuple[int, memoryview]] = field(default_factory=list)
    # Allowed tokens of the constrained sequences that sample (None: none is constrained).
    grammar_bitmask: GrammarBitmask | None = None

    @property
    def num_tokens(self) -> int:
        return sum(c.num_query_tokens for c in self.chunks)


@dataclass(slots=True)
class RunnerOutput:
    """What the runner hands back for a plan, as plain Python values."""

    # seq_id -> tokens sampled for it this step: one, or with drafts the accepted ones and the
    # token after them
    sampled_token_ids: dict[int, list[int]] = field(default_factory=dict)
    # seq_id -> logprobs of each sampled token (only sequences that asked)
    logprobs: dict[int, list[PositionLogprobs]] = field(default_factory=dict)
    # seq_id -> logprobs of the prompt tokens this step's chunk predicted
    prompt_logprobs: dict[int, list[PositionLogprobs]] = field(default_factory=dict)
    # the bytes of the plan's tier_saves blocks, in its order (under tensor parallelism the
    # executor joins every rank's shard of each: engine/executor/tier_shards.py)
    saved_blocks: list[bytes] = field(default_factory=list)
