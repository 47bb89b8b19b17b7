"""Turns a batch of next-token logits into tokens (and logprobs), vectorised across rows.

The steps and their order follow vLLM so that outputs and user expectations match:
logit_bias -> penalties (repetition on prompt+output, frequency/presence on output counts)
-> allowed tokens (structured outputs' grammar, allowed_token_ids) -> min_tokens and bad-word
bans -> a spent reasoning budget's forced token -> greedy rows take argmax -> other rows:
temperature, top-k, top-p, min-p, then sample.

Sampling uses the "exponential race" (argmax of probs / q with q ~ Exp(1)), which is equivalent
to drawing from the categorical distribution but lets each seeded row draw its own q with its
own generator: a seeded row gets the same token whatever else is in the batch. Everything a
step needs comes in a SamplingMetadata of tensors (see sampling_metadata.py).

Logprobs are those of the raw logits (the model's distribution before temperature and
penalties), vLLM's default "raw_logprobs" mode.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from octavo.model.sample.metadata import SamplingMetadata
from octavo.outputs import Logprob, PositionLogprobs


@dataclass
class SamplerOutput:
    sampled_token_ids: list[int]
    # Per row: None when the row did not ask for logprobs.
    logprobs: list[PositionLogprobs | None]


class Sampler:
    """Stateless: everything a step needs is in the SamplingMetadata (stateful custom logits
    processors are the runner's, passed in as one callable)."""

    def __call__(self, logits: Tensor, batch: SamplingMetadata,
                 custom: Callable[[Tensor], Tensor] | None = None) -> SamplerOutput:
        """`custom`: the engine's logits processors (model/sample/logits_processor.py), applied
        after the penalties."""
        if logits.dim() != 2 or logits.shape[0] != len(batch.num_logprobs):
            raise ValueError(f"logits must be [N, V] with N={len(batch.num_logprobs)}")
        raw = logits
        # A float32 copy where a step below works in place (bias, penalties, the processors,
        # allowed tokens, bans), so the caller's logits stay untouched; greedy rows and plain
        # sampling only read them (12 MB not copied per step at 64 rows of a 49k vocabulary).
        in_place = (batch.logit_bias is not None or batch.do_penalties or custom is not None
                    or batch.allowed is not None or any(batch.banned_token_ids)
                    or bool(batch.forced))
        logits = logits.to(torch.float32, copy=in_place)
        if batch.logit_bias is not None:
            rows, ids, values = batch.logit_bias
            logits.index_put_((torch.tensor(rows, device=logits.device),
                               torch.tensor(ids, device=logits.device)),
                              torch.tensor(values, dtype=torch.float32, device=logits.device),
                              accumulate=True)
        if batch.do_penalties:
            logits = apply_penalties(logits, batch)
        if custom is not None:
            logits = custom(logits)
        if batch.allowed is not None:
            logits = apply_allowed(logits, *batch.allowed)
        if any(batch.banned_token_ids):
            before = logits.clone() if batch.allowed is not None else None
            logits = apply_bans(logits, batch.banned_token_ids)
            if before is not None:
                # a grammar that allows only EOS (complete) wins over min_tokens' EOS ban:
                # a row left with no token at all keeps its allowed tokens
                dead = torch.isneginf(logits).all(dim=-1)
                if bool(dead.any()):
                    logits[dead] = before[dead]
        if batch.forced:
            logits = apply_forced(logits, batch.forced)

        tokens = row_argmax(logits) if batch.all_greedy else self._sample(logits, batch)
        token_list = tokens.tolist()
        return SamplerOutput(
            sampled_token_ids=token_list,
            logprobs=_sample_logprobs(raw, token_list, batch.num_logprobs),
        )

    def _sample(self, logits: Tensor, batch: SamplingMetadata) -> Tensor:
        greedy_tokens = row_argmax(logits)
        rows = (~batch.greedy).nonzero().squeeze(1)
        sub = logits.index_select(0, rows)
        sub.div_(batch.temperatures.index_select(0, rows).unsqueeze(1))
        if batch.do_top_k or batch.do_top_p:
            sub = apply_top_k_top_p(
                sub,
                batch.top_ks.index_select(0, rows) if batch.do_top_k else None,
                batch.top_ps.index_select(0, rows) if batch.do_top_p else None,
            )
        if batch.do_min_p:
            sub = apply_min_p(sub, batch.min_ps.index_select(0, rows))
        probs = sub.softmax(dim=-1)
        gens = [batch.generators[i] for i in rows.tolist()]
        sampled = exponential_race(probs, gens)
        return greedy_tokens.index_copy(0, rows, sampled)


def apply_forced(logits: Tensor, forced: list[tuple[int, int]]) -> Tensor:
    """Each (row, token): the row may sample only that token, unless a constraint (a grammar,
    allowed_token_ids, a ban) already ruled it out: constraints win over a reasoning budget."""
    for row, token in forced:
        value = logits[row, token].item()
        if value != float("-inf"):
            logits[row].fill_(float("-inf"))
            logits[row, token] = value
    return logits


def row_argmax(x: Tensor) -> Tensor:
    """Each row's argmax: the first index of its largest value (NaN counts as largest), as
    Tensor.argmax gives. `max(dim=-1)` computes the same indices 2-5x faster on CPU in torch
    2.13 (argmax's reduction is not vectorized there): 1.7 against 4.8 ms for 64 rows of a 49k
    vocabulary on one thread, about 1% of a `mixed` step (BENCHMARKS.md section 8)."""
    return x.max(dim=-1).indices


def token_counts(token_ids: Sequence[list[int]], vocab_size: int, device: torch.device) -> Tensor:
    """[N, V] occurrence counts, built with one scatter_add over a padded id tensor."""
    n = len(token_ids)
    width = max((len(ids) for ids in token_ids), default=0)
    counts = torch.zeros((n, vocab_size + 1), dtype=torch.float32, device=device)
    if width:
        padded = torch.tensor(
            [ids + [vocab_size] * (width - len(ids)) for ids in token_ids],
            dtype=torch.int64,
            device=device,
        )
        counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=torch.float32))
    return counts[:, :vocab_size]


def apply_penalties(logits: Tensor, batch: SamplingMetadata) -> Tensor:
    """vLLM's penalties: repetition on prompt+output tokens, frequency/presence on outputs.

    repetition: seen tokens' logits are divided by the penalty when positive and multiplied
    when negative; frequency: minus penalty x count; presence: minus penalty if present.
    """
    vocab = logits.shape[1]
    output_counts = token_counts(batch.output_token_ids, vocab, logits.device)
    output_mask = output_counts > 0
    seen = token_counts(batch.prompt_token_ids, vocab, logits.device) > 0
    seen |= output_mask
    rep = batch.repetition_penalties.unsqueeze(1)
    penalised = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalised, logits)
    logits -= batch.frequency_penalties.unsqueeze(1) * output_counts
    logits -= batch.presence_penalties.unsqueeze(1) * output_mask
    return logits


def apply_allowed(logits: Tensor, rows: Tensor, allowed: Tensor) -> Tensor:
    """Set the logits of the tokens a row may not sample to -inf (grammar, allowed_token_ids)."""
    if rows.numel() == logits.shape[0]:  # every row constrained: no gather / scatter
        return logits.masked_fill_(~allowed, float("-inf"))
    sub = logits.index_select(0, rows)
    sub.masked_fill_(~allowed, float("-inf"))
    return logits.index_copy_(0, rows, sub)


def apply_bans(logits: Tensor, banned: Sequence[list[int]]) -> Tensor:
    """Set banned token logits to -inf (min_tokens: EOS and stop ids can't be chosen yet)."""
    rows = [r for r, ids in enumerate(banned) for _ in ids]
    cols = [i for ids in banned for i in ids]
    logits[rows, cols] = float("-inf")
    return logits


def apply_top_k_top_p(logits: Tensor, top_k: Tensor | None, top_p: Tensor | None) -> Tensor:
    """Mask all but the top-k logits and the smallest set of tokens with mass >= top_p.

    One ascending sort serves both filters (vLLM's approach); ties at the k-th value are kept.
    """
    vocab = logits.shape[1]
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    if top_k is not None:
        kth = (vocab - top_k).clamp(min=0).unsqueeze(1)
        threshold = sorted_logits.gather(1, kth)
        sorted_logits.masked_fill_(sorted_logits < threshold, float("-inf"))
    if top_p is not None:
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        mask = cumulative <= (1.0 - top_p).unsqueeze(1)
        mask[:, -1] = False  # always keep the most likely token
        sorted_logits.masked_fill_(mask, float("-inf"))
    return torch.empty_like(sorted_logits).scatter_(1, order, sorted_logits)


def apply_min_p(logits: Tensor, min_p: Tensor) -> Tensor:
    """Drop tokens whose probability is below min_p x the top token's probability."""
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return logits.masked_fill_(probs < threshold, float("-inf"))


def exponential_race(probs: Tensor, generators: Sequence[torch.Generator | None]) -> Tensor:
    """Sample one token per row: argmax(probs / q), q ~ Exp(1).

    Seeded rows draw q with their own generator (batch-independent); the others share one
    draw from the global RNG.
    """
    q = torch.empty_like(probs)
    unseeded = [i for i, g in enumerate(generators) if g is None]
    if unseeded:
        idx = torch.tensor(unseeded, dtype=torch.int64, device=probs.device)
        draw = torch.empty((len(unseeded), probs.shape[1]), dtype=q.dtype, device=q.device)
        q.index_copy_(0, idx, draw.exponential_())
    for i, gen in enumerate(generators):
        if gen is not None:
            q[i].exponential_(generator=gen)
    # exponential_ can return 0 at float32 resolution; a zero-probability token must never win.
    q.clamp_(min=torch.finfo(q.dtype).tiny)
    return row_argmax(probs.div_(q))


def compute_logprobs(logits: Tensor, token_ids: Sequence[int], num_logprobs: int) -> list:
    """Logprobs of `token_ids` (one per row) with ranks, plus each row's top `num_logprobs`.

    Works for sampled tokens and for prompt logprobs (row t's logits scored against prompt
    token t+1). Returns one PositionLogprobs per row.
    """
    lps = logits.to(torch.float32).log_softmax(dim=-1)
    tokens = torch.tensor(list(token_ids), dtype=torch.int64, device=lps.device).unsqueeze(1)
    chosen = lps.gather(1, tokens)
    ranks = (lps > chosen).sum(dim=-1) + 1
    result: list[PositionLogprobs] = []
    if num_logprobs > 0:
        top_vals, top_ids = lps.topk(min(num_logprobs, lps.shape[1]), dim=-1)
        top_vals, top_ids = top_vals.tolist(), top_ids.tolist()
    for r, (tok, lp, rank) in enumerate(
        zip(tokens.squeeze(1).tolist(), chosen.squeeze(1).tolist(), ranks.tolist(), strict=True)
    ):
        entry: PositionLogprobs = {}
        if num_logprobs > 0:
            for k, (tid, val) in enumerate(zip(top_ids[r], top_vals[r], strict=True)):
                entry[tid] = Logprob(val, k + 1)
        if tok not in entry:
            entry[tok] = Logprob(lp, rank)
        result.append(entry)
    return result


def _sample_logprobs(
    raw: Tensor, tokens: list[int], num_logprobs: list[int | None]
) -> list[PositionLogprobs | None]:
    out: list[PositionLogprobs | None] = [None] * len(tokens)
    wanted = [i for i, k in enumerate(num_logprobs) if k is not None]
    if not wanted:
        return out
    # Rows asking for the same k share one call; usually that is every row.
    by_k: dict[int, list[int]] = {}
    for i in wanted:
        by_k.setdefault(num_logprobs[i], []).append(i)
    for k, rows in by_k.items():
        idx = torch.tensor(rows, dtype=torch.int64, device=raw.device)
        entries = compute_logprobs(raw.index_select(0, idx), [tokens[i] for i in rows], k)
        for i, entry in zip(rows, entries, strict=True):
            out[i] = entry
    return out
