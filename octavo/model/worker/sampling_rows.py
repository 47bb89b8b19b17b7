"""Which rows of a step's logits sample, for which sequence, at which draft position.

A chunk without drafts samples one row per sequence it samples for (a fan-out chunk: every
sample of a prompt from its last row). A chunk with k drafts samples k + 1 rows, row j as if
the drafts before it were already the sequence's outputs: its history is the tokens plus
drafts[:j], so penalties, bans and seeded draws are those plain decoding would have there.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from octavo.step_plan import SeqChunk, StepPlan


@dataclass(slots=True)
class SamplingRows:
    rows: list[int] = field(default_factory=list)  # row of the step's sampling logits
    seq_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)  # draft position (0: the next token)
    histories: list[list[int]] = field(default_factory=list)  # the tokens before the row
    spec: list[tuple[SeqChunk, int]] = field(default_factory=list)  # (chunk, its first row)

    def _add(self, row: int, seq_id: int, position: int, history: list[int]) -> None:
        self.rows.append(row)
        self.seq_ids.append(seq_id)
        self.positions.append(position)
        self.histories.append(history)


def sampling_rows(plan: StepPlan, seqs: dict[int, Any]) -> SamplingRows:
    """The step's sampling rows; `seqs`: the runner's per-sequence state (token_ids)."""
    out = SamplingRows()
    row = 0
    for chunk in plan.chunks:
        if not chunk.sample_seq_ids:
            continue
        if chunk.draft_token_ids:
            assert chunk.sample_seq_ids == (chunk.seq_id,), "drafts on a fan-out chunk"
            tokens, drafts = seqs[chunk.seq_id].token_ids, chunk.draft_token_ids
            out.spec.append((chunk, len(out.seq_ids)))
            for j in range(len(drafts) + 1):
                out._add(row + j, chunk.seq_id, j, tokens + drafts[:j] if j else tokens)
            row += len(drafts) + 1
            continue
        for seq_id in chunk.sample_seq_ids:
            out._add(row, seq_id, 0, seqs[seq_id].token_ids)
        row += 1
    return out


def grammar_rows(plan: StepPlan, rows: SamplingRows) -> tuple[list[int], Any] | None:
    """The structured-outputs bitmask (computed while the forward ran) and the sampling row
    each of its rows belongs to, or None."""
    gb = plan.grammar_bitmask
    if gb is None:
        return None
    row_of = {key: r for r, key in enumerate(zip(rows.seq_ids, rows.positions, strict=True))}
    keys = zip(gb.seq_ids, gb.positions or [0] * len(gb.seq_ids), strict=True)
    return [row_of[key] for key in keys], gb.pending.result()
