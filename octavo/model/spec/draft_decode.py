"""One greedy drafting step: a single-token decode row per drafting sequence through a draft
model (or the target's first layers), and each row's argmax. Both drafters run it for every
draft after their first."""

from __future__ import annotations

import torch

from octavo.model.layers.attention.base import AttentionBackend
from octavo.model.layers.kv_cache import KVCache
from octavo.model.sample.sampler import row_argmax
from octavo.model.spec.batch import DraftBatch
from octavo.step_plan import SeqChunk


def greedy_decode(model: torch.nn.Module, rows: list[SeqChunk], batch: DraftBatch,
                  kv_cache: KVCache, backend: AttentionBackend,
                  num_layers: int | None = None) -> list[int]:
    """The argmax next token of each one-token row (all decodes: rows stay in order)."""
    inputs = batch.prepare(rows)
    logits = model(inputs.input_ids, inputs.positions, kv_cache, inputs.metas, backend,
                   torch.arange(len(rows), device=batch.device), num_layers=num_layers)
    return row_argmax(logits).tolist()
