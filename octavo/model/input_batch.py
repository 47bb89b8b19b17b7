"""What the runner keeps of each sequence between steps, and how a step's chunks become inputs.

A StepPlan names sequences by id and carries only what changed; `InputBatch.apply(plan)` brings
the kept state up to date (forget, add, new block ids, the chunk's tokens), and `prepare`
flattens the chunks into one batch, decodes first (vLLM's convention): token ids, positions,
the slot mapping and the attention metadata.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from octavo.model.attention.base import AttentionMetadata, PrefillChunk
from octavo.sampling_params import SamplingParams
from octavo.step_plan import SeqChunk, StepPlan


class SeqState:
    __slots__ = ("token_ids", "num_prompt_tokens", "index", "params", "block_table")

    def __init__(self, token_ids: list[int], num_prompt_tokens: int, index: int,
                 params: SamplingParams, block_table: list[int]) -> None:
        self.token_ids = token_ids
        self.num_prompt_tokens = num_prompt_tokens
        self.index = index
        self.params = params
        self.block_table = block_table


@dataclass(slots=True)
class ModelInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    order: list[int]  # chunk indices in batch order (decodes first)


class InputBatch:
    def __init__(self, block_size: int, device: torch.device) -> None:
        self.block_size = block_size
        self.device = device
        self.seqs: dict[int, SeqState] = {}

    def apply(self, plan: StepPlan) -> None:
        for seq_id in plan.finished_seq_ids:
            self.seqs.pop(seq_id, None)
        for new in plan.new_seqs:
            self.seqs[new.seq_id] = SeqState(list(new.token_ids), new.num_prompt_tokens,
                                             new.index, new.params, list(new.block_ids))
        for seq_id, start, block_ids in plan.block_table_updates:
            table = self.seqs[seq_id].block_table
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

    def prepare(self, chunks: list[SeqChunk]) -> ModelInputs:
        bs, device = self.block_size, self.device
        decode_idx = [i for i, c in enumerate(chunks) if len(c.token_ids) == 1]
        prefill_idx = [i for i, c in enumerate(chunks) if len(c.token_ids) > 1]
        tokens: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        decode_tables = decode_lens = None
        if decode_idx:
            tables = []
            lens = []
            for i in decode_idx:
                c = chunks[i]
                table = self.seqs[c.seq_id].block_table
                pos = c.start_pos
                tokens.append(c.token_ids[0])
                positions.append(pos)
                slots.append(table[pos // bs] * bs + pos % bs)
                tables.append(table)
                lens.append(pos + 1)
            width = -(-max(lens) // bs)
            rows = [(t[:width] + [0] * width)[:width] for t in tables]
            decode_tables = torch.tensor(rows, dtype=torch.long, device=device)
            decode_lens = torch.tensor(lens, dtype=torch.long, device=device)
        prefills: list[PrefillChunk] = []
        prefill_slots: list[torch.Tensor] = []
        row = len(decode_idx)
        for i in prefill_idx:
            c = chunks[i]
            n = len(c.token_ids)
            nblocks = -(-c.context_len // bs)
            table = torch.tensor(self.seqs[c.seq_id].block_table[:nblocks], dtype=torch.long)
            pos = torch.arange(c.start_pos, c.context_len)
            prefill_slots.append(table[pos // bs] * bs + pos % bs)
            tokens.extend(c.token_ids)
            positions.extend(range(c.start_pos, c.context_len))
            prefills.append(PrefillChunk(row, row + n, c.start_pos, table.to(device)))
            row += n
        slot_mapping = torch.cat([torch.tensor(slots, dtype=torch.long), *prefill_slots])
        meta = AttentionMetadata(
            slot_mapping=slot_mapping.to(device),
            num_decodes=len(decode_idx),
            decode_block_tables=decode_tables,
            decode_context_lens=decode_lens,
            prefills=prefills,
        )
        return ModelInputs(
            input_ids=torch.tensor(tokens, dtype=torch.long, device=device),
            positions=torch.tensor(positions, dtype=torch.long, device=device),
            meta=meta,
            order=decode_idx + prefill_idx,
        )
