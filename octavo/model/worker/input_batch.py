"""What the runner keeps of each sequence between steps, and how a step's chunks become inputs.

A StepPlan names sequences by id and carries only what changed; `InputBatch.apply(plan)` brings
the kept state up to date (forget, add, new block ids, the chunk's tokens), and `prepare`
flattens the chunks into one batch, decodes first (vLLM's convention): token ids, positions,
the slot mapping and the attention metadata; for a model with recurrent layers also the state
group's metadata (each sequence's state slot, the snapshots the step takes), last in `metas`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from octavo.model.layers.attention.base import AttentionMetadata, PrefillChunk
from octavo.model.layers.recurrent.state import StateChunk, StateMetadata
from octavo.sampling_params import SamplingParams
from octavo.step_plan import SeqChunk, StepPlan


class SeqState:
    __slots__ = ("token_ids", "num_prompt_tokens", "index", "params", "block_tables")

    def __init__(self, token_ids: list[int], num_prompt_tokens: int, index: int,
                 params: SamplingParams, block_tables: list[list[int]]) -> None:
        self.token_ids = token_ids
        self.num_prompt_tokens = num_prompt_tokens
        self.index = index
        self.params = params
        self.block_tables = block_tables  # one per KV cache group

    @property
    def block_table(self) -> list[int]:
        return self.block_tables[0]


@dataclass(slots=True)
class ModelInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    # one per KV cache group (a model with recurrent layers: the StateMetadata last)
    metas: list
    order: list[int]  # chunk indices in batch order (decodes first)

    @property
    def meta(self) -> AttentionMetadata:
        return self.metas[0]


class InputBatch:
    """`windows`: per KV cache group, its sliding window (None: full attention). A sliding
    group's decode reads only the blocks its window covers. `state`: the model has recurrent
    layers, whose state group comes after the attention groups (its table: the state slot)."""

    def __init__(self, block_size: int, device: torch.device,
                 windows: tuple[int | None, ...] = (None,), state: bool = False) -> None:
        self.block_size = block_size
        self.device = device
        self.windows = windows
        self.state = state
        self.seqs: dict[int, SeqState] = {}

    def apply(self, plan: StepPlan) -> None:
        for seq_id in plan.finished_seq_ids:
            self.seqs.pop(seq_id, None)
        groups = len(self.windows) + self.state
        for new in plan.new_seqs:
            tables = [list(new.block_ids), *(list(t) for t in new.group_block_ids)]
            if len(tables) != groups:
                raise ValueError(f"sequence {new.seq_id}: {len(tables)} block tables for "
                                 f"{groups} KV cache groups")
            self.seqs[new.seq_id] = SeqState(list(new.token_ids), new.num_prompt_tokens,
                                             new.index, new.params, tables)
        updates = [(seq_id, 0, start, ids) for seq_id, start, ids in plan.block_table_updates]
        for seq_id, group, start, block_ids in updates + plan.group_table_updates:
            table = self.seqs[seq_id].block_tables[group]
            if start > len(table):
                raise ValueError(f"sequence {seq_id}: block table update at {start} leaves a "
                                 f"gap after {len(table)} entries")
            table[start:] = block_ids
        for chunk in plan.chunks:
            tokens = self.seqs[chunk.seq_id].token_ids
            start, n = chunk.start_pos, len(chunk.token_ids)
            if start > len(tokens):
                raise ValueError(f"sequence {chunk.seq_id}: chunk at {start} leaves a gap after "
                                 f"{len(tokens)} known tokens")
            if start + n > len(tokens):
                tokens[start:] = chunk.token_ids
            elif tokens[start : start + n] != chunk.token_ids:
                raise ValueError(f"sequence {chunk.seq_id}: chunk tokens differ from the known "
                                 f"tokens at {start}")

    def prepare(self, chunks: list[SeqChunk],
                snapshots: list[tuple[int, int, int]] | None = None) -> ModelInputs:
        """`snapshots`: the plan's state snapshots, (seq_id, position, slot)."""
        device = self.device
        # a chunk with drafts computes them after its known tokens, like a prefill chunk
        decode_idx = [i for i, c in enumerate(chunks) if c.num_query_tokens == 1]
        prefill_idx = [i for i, c in enumerate(chunks) if c.num_query_tokens > 1]
        tokens: list[int] = [chunks[i].token_ids[0] for i in decode_idx]
        positions: list[int] = [chunks[i].start_pos for i in decode_idx]
        for i in prefill_idx:
            c = chunks[i]
            tokens.extend(c.token_ids)
            tokens.extend(c.draft_token_ids)
            positions.extend(range(c.start_pos, c.start_pos + c.num_query_tokens))
        metas: list = [self._group_meta(g, chunks, decode_idx, prefill_idx)
                       for g in range(len(self.windows))]
        if self.state:
            metas.append(self._state_meta(chunks, decode_idx, prefill_idx, snapshots or []))
        return ModelInputs(
            input_ids=torch.tensor(tokens, dtype=torch.long, device=device),
            positions=torch.tensor(positions, dtype=torch.long, device=device),
            metas=metas,
            order=decode_idx + prefill_idx,
        )

    def _state_meta(self, chunks: list[SeqChunk], decode_idx: list[int], prefill_idx: list[int],
                    snapshots: list[tuple[int, int, int]]) -> StateMetadata:
        group = len(self.windows)
        slots = [self.seqs[chunks[i].seq_id].block_tables[group][0] for i in decode_idx]
        fresh = [slot for i, slot in zip(decode_idx, slots, strict=True)
                 if chunks[i].start_pos == 0]
        asked = {seq_id: (pos, slot) for seq_id, pos, slot in snapshots}
        prefills = []
        row = len(decode_idx)
        for i in prefill_idx:
            c = chunks[i]
            n = c.num_query_tokens
            snap = asked.get(c.seq_id)
            if snap is not None:
                snap = (snap[0] - c.start_pos, snap[1])
                if not 0 < snap[0] < n:
                    raise ValueError(f"sequence {c.seq_id}: a state snapshot at {snap[0]} "
                                     f"tokens into a chunk of {n}")
            prefills.append(StateChunk(row, row + n, self.seqs[c.seq_id].block_tables[group][0],
                                       c.start_pos, snap))
            row += n
        return StateMetadata(len(decode_idx),
                             torch.tensor(slots, dtype=torch.long, device=self.device), fresh,
                             prefills)

    def _group_meta(self, group: int, chunks: list[SeqChunk], decode_idx: list[int],
                    prefill_idx: list[int]) -> AttentionMetadata:
        bs, device, window = self.block_size, self.device, self.windows[group]
        slots: list[int] = []
        decode_tables = decode_lens = decode_first = None
        if decode_idx:
            tables = []
            lens = []
            firsts = []
            for i in decode_idx:
                c = chunks[i]
                table = self.seqs[c.seq_id].block_tables[group]
                pos = c.start_pos
                slots.append(table[pos // bs] * bs + pos % bs)
                # a sliding group reads only its window's blocks (those before it are freed)
                first = 0 if window is None else max(0, pos - window + 1) // bs
                tables.append(table[first : pos // bs + 1])
                firsts.append(first * bs)
                lens.append(pos + 1)
            width = max(len(t) for t in tables)
            rows = [t + [0] * (width - len(t)) for t in tables]
            decode_tables = torch.tensor(rows, dtype=torch.long, device=device)
            decode_lens = torch.tensor(lens, dtype=torch.long, device=device)
            if window is not None:
                decode_first = torch.tensor(firsts, dtype=torch.long, device=device)
        prefills: list[PrefillChunk] = []
        prefill_slots: list[torch.Tensor] = []
        row = len(decode_idx)
        for i in prefill_idx:
            c = chunks[i]
            n = c.num_query_tokens
            end = c.start_pos + n
            nblocks = -(-end // bs)
            table = torch.tensor(self.seqs[c.seq_id].block_tables[group][:nblocks],
                                 dtype=torch.long)
            pos = torch.arange(c.start_pos, end)
            prefill_slots.append(table[pos // bs] * bs + pos % bs)
            prefills.append(PrefillChunk(row, row + n, c.start_pos, table.to(device)))
            row += n
        slot_mapping = torch.cat([torch.tensor(slots, dtype=torch.long), *prefill_slots])
        return AttentionMetadata(
            slot_mapping=slot_mapping.to(device),
            num_decodes=len(decode_idx),
            decode_block_tables=decode_tables,
            decode_context_lens=decode_lens,
            prefills=prefills,
            decode_first_pos=decode_first,
        )
