"""A separate, smaller draft model over its own paged KV cache (speculative decoding's
`draft_model` method).

The draft model's KV cache has the target's blocks: the same number, the same block size, and
the same block tables (a position's slot is the same in both), so the KV manager's allocation,
lookahead slots, frees and prefix hits serve it unchanged; only the tensors differ. What the
draft cache holds is tracked per sequence as a frontier: the positions whose draft K/V are
written. A step that drafts for a sequence first runs the draft over the tokens from its
frontier to the last known one (the whole prompt the first time, afterwards the tokens the last
verification accepted), takes the first draft from that chunk's last row, then runs k - 1
single-token steps for the others. Prefix hits and forks start at frontier 0 (a shared block's
draft K/V are written again with the same values), preemption and swap-in too. Drafts are
greedy (a deterministic proposal, verified exactly by the runner's per-position sampling).
"""

from __future__ import annotations

import torch

from octavo.config import ModelConfig
from octavo.model.layers.attention.base import AttentionBackend
from octavo.model.layers.kv_cache import KVCache
from octavo.model.sample.sampler import row_argmax
from octavo.model.spec.batch import DraftBatch
from octavo.model.spec.draft_decode import greedy_decode
from octavo.step_plan import SeqChunk


def num_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


class DraftModelDrafter:
    def __init__(self, model: torch.nn.Module, config: ModelConfig,
                 target: torch.nn.Module, target_config: ModelConfig) -> None:
        if config.vocab_size != target_config.vocab_size:
            raise ValueError(f"speculative_config: the draft model's vocabulary "
                             f"({config.vocab_size}) differs from the target's "
                             f"({target_config.vocab_size})")
        for name, c in (("draft", config), ("target", target_config)):
            if c.kv_groups.num_groups != 1:
                raise ValueError(f"speculative_config: the {name} model keeps several KV cache "
                                 "groups (sliding-window layers); a draft model needs one each")
        self.model = model
        self.config = config
        self.share = num_params(model) / num_params(target)  # a draft token's relative cost
        self.kv_cache: KVCache | None = None
        self.frontier: dict[int, int] = {}

    def init_kv_cache(self, num_blocks: int, block_size: int, dtype: torch.dtype,
                      device: torch.device) -> None:
        self.kv_cache = KVCache(self.config, num_blocks, block_size, dtype, device)

    def forget(self, seq_id: int) -> None:
        self.frontier.pop(seq_id, None)

    def accepted(self, seq_id: int, start: int, num_accepted: int) -> None:
        """The verification of drafts that followed position `start` kept `num_accepted`:
        the draft K/V written for the rejected ones are stale."""
        if seq_id in self.frontier:
            self.frontier[seq_id] = min(self.frontier[seq_id], start + 1 + num_accepted)

    @torch.inference_mode()
    def propose(self, chunks: list[SeqChunk], batch: DraftBatch, kv_cache: KVCache,
                backend: AttentionBackend) -> dict[int, list[int]]:
        assert self.kv_cache is not None, "init_kv_cache first"
        want = [c for c in chunks if c.num_draft_tokens and not c.draft_token_ids]
        drafts: dict[int, list[int]] = {c.seq_id: [] for c in want}
        if not want:
            return drafts
        device = batch.device
        # 1. catch up from each frontier to the last known token; its last row drafts first
        rows = []
        for c in want:
            end = c.context_len  # the last known token sits at end - 1
            start = min(self.frontier.get(c.seq_id, 0), end - 1)
            rows.append(SeqChunk(c.seq_id, batch.seqs[c.seq_id].token_ids[start:end], start))
        inputs = batch.prepare(rows)
        at, last_rows = 0, {}
        for i in inputs.order:
            at += len(rows[i].token_ids)
            last_rows[i] = at - 1
        index = torch.tensor([last_rows[i] for i in range(len(rows))], dtype=torch.long,
                             device=device)
        logits = self.model(inputs.input_ids, inputs.positions, self.kv_cache, inputs.metas,
                            backend, index)
        for c, token in zip(want, row_argmax(logits).tolist(), strict=True):
            drafts[c.seq_id].append(token)
            self.frontier[c.seq_id] = c.context_len
        # 2. one token at a time for the rest
        for j in range(1, max(c.num_draft_tokens for c in want)):
            active = [c for c in want if c.num_draft_tokens > j]
            steps = [SeqChunk(c.seq_id, [drafts[c.seq_id][-1]], c.context_len - 1 + j)
                     for c in active]
            tokens = greedy_decode(self.model, steps, batch, self.kv_cache, backend)
            for c, token in zip(active, tokens, strict=True):
                drafts[c.seq_id].append(token)
                self.frontier[c.seq_id] = c.context_len + j
        return drafts
