"""Self-drafting: the target's own first layers and its LM head propose the draft tokens.

For a model with no smaller sibling. Each draft token costs one forward of the first
`num_layers` layers over the drafting sequences (one decode row each), run k times in turn.
No second KV cache is needed: those layers' K/V are the target's own, so the draft reads the
target's cache for every computed position and writes its lookahead slots, which the
verification pass then writes again with the same layers' values for the same tokens.
Drafts are greedy (the draft's argmax): a deterministic proposal, which the runner's
per-position sampling verifies exactly (model/spec/draft_acceptance.py).
"""

from __future__ import annotations

import torch

from octavo.model.layers.attention.base import AttentionBackend
from octavo.model.layers.kv_cache import KVCache
from octavo.model.spec.batch import DraftBatch
from octavo.model.spec.draft_decode import greedy_decode
from octavo.step_plan import SeqChunk


class SelfDrafter:
    def __init__(self, model: torch.nn.Module, num_layers: int | None) -> None:
        total = len(model.layers)
        layers = max(1, total // 4) if num_layers is None else num_layers
        if not 1 <= layers < total:
            raise ValueError(f"speculative_config: num_draft_layers must be in [1, {total - 1}] "
                             f"for a model of {total} layers, got {layers}")
        self.model = model
        self.num_layers = layers
        self.share = layers / total  # a draft token's cost, as a share of a target token's

    def init_kv_cache(self, num_blocks: int, block_size: int, dtype: torch.dtype,
                      device: torch.device) -> None:
        """Nothing to allocate: the draft layers' K/V are the target's."""

    def forget(self, seq_id: int) -> None:
        """Nothing kept per sequence."""

    def accepted(self, seq_id: int, start: int, num_accepted: int) -> None:
        """Nothing to invalidate: the verification rewrote the draft layers' K/V."""

    @torch.inference_mode()
    def propose(self, chunks: list[SeqChunk], batch: DraftBatch, kv_cache: KVCache,
                backend: AttentionBackend) -> dict[int, list[int]]:
        """Drafts for every chunk that asks for `num_draft_tokens` (its known tokens end at the
        position the first draft follows); the batch's block tables cover the lookahead."""
        want = [c for c in chunks if c.num_draft_tokens and not c.draft_token_ids]
        drafts: dict[int, list[int]] = {c.seq_id: [] for c in want}
        last = {c.seq_id: c.token_ids[-1] for c in want}
        pos = {c.seq_id: c.context_len - 1 for c in want}
        for j in range(max((c.num_draft_tokens for c in want), default=0)):
            active = [c.seq_id for c in want if c.num_draft_tokens > j]
            rows = [SeqChunk(s, [last[s]], pos[s] + j) for s in active]
            tokens = greedy_decode(self.model, rows, batch, kv_cache, backend,
                                   num_layers=self.num_layers)
            for s, token in zip(active, tokens, strict=True):
                drafts[s].append(token)
                last[s] = token
        return drafts
