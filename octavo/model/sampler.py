"""Turns a batch of next-token logits into tokens (and logprobs), vectorised across rows.

The steps and their order follow vLLM so that outputs and user expectations match:
penalties (repetition on prompt+output, frequency/presence on output counts) -> min_tokens ban
-> greedy rows take argmax -> other rows: temperature, top-k, top-p, min-p, then sample.

Sampling uses the "exponential race" (argmax of probs / q with q ~ Exp(1)), which is equivalent
to drawing from the categorical distribution but lets each seeded row draw its own q with its
own generator: a seeded row gets the same token whatever else is in the batch.

Logprobs are those of the raw logits (the model's distribution before temperature and
penalties), vLLM's default "raw_logprobs" mode.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from octavo.engine.sampling_params import SAMPLING_EPS, SamplingParams


@dataclass
class Logprob:
    """Logprob of one token at one position; rank 1 is the most likely token."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One position's logprobs: the top-k tokens in descending order (ranks 1..k), then the
# chosen token if it was not among them.
PositionLogprobs = dict[int, Logprob]


@dataclass
class SamplerOutput:
    sampled_token_ids: list[int]
    # Per row: None when the row did not ask for logprobs.
    logprobs: list[PositionLogprobs | None]


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A per-request generator; the engine keeps it for the request's lifetime."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen


def _step_generator(seed: int, step: int, device: torch.device | str) -> torch.Generator:
    # Stateless fallback: a generator derived from (seed, tokens generated so far) gives the
    # same draw for the same position even after preemption and recompute.
    return make_generator((seed * 1_000_003 + step) % (2**63 - 1), device)


@dataclass
class SamplingBatch:
    """Per-row sampling settings of one step, as tensors; built once per step by the engine."""

    temperatures: Tensor  # [N] float32; 1.0 for greedy rows (never divided by zero)
    top_ps: Tensor  # [N] float32
    top_ks: Tensor  # [N] int64; vocab_size when disabled
    min_ps: Tensor  # [N] float32
    presence_penalties: Tensor  # [N] float32
    frequency_penalties: Tensor  # [N] float32
    repetition_penalties: Tensor  # [N] float32
    greedy: Tensor  # [N] bool
    generators: list[torch.Generator | None]  # None = global RNG
    output_token_ids: list[list[int]]
    prompt_token_ids: list[list[int]]
    banned_token_ids: list[list[int]]  # EOS/stop ids suppressed this step (min_tokens)
    num_logprobs: list[int | None]
    vocab_size: int
    # Shortcuts so a plain batch skips work it does not need.
    all_greedy: bool = False
    do_penalties: bool = False
    do_top_k: bool = False
    do_top_p: bool = False
    do_min_p: bool = False

    @classmethod
    def from_params(
        cls,
        params: Sequence[SamplingParams],
        prompt_token_ids: Sequence[list[int]],
        output_token_ids: Sequence[list[int]],
        generators: Sequence[torch.Generator | None] | None,
        vocab_size: int,
        device: torch.device | str = "cpu",
        eos_token_id: int | None = None,
    ) -> SamplingBatch:
        """Gather the rows' settings into tensors.

        `generators=None` derives a generator per seeded row from (seed, step), so callers
        without per-request state still get reproducible, batch-independent draws; pass a list
        to control the streams (None entries use the global RNG). `eos_token_id` is banned
        with the stop token ids while a row has fewer than min_tokens outputs (unless
        ignore_eos).
        """
        n = len(params)
        if not (len(prompt_token_ids) == len(output_token_ids) == n):
            raise ValueError("params, prompt_token_ids and output_token_ids differ in length")
        if generators is None:
            generators = [
                None if p.seed is None else _step_generator(p.seed, len(out), device)
                for p, out in zip(params, output_token_ids, strict=True)
            ]
        elif len(generators) != n:
            raise ValueError("generators must have one entry per row")

        greedy = [p.temperature < SAMPLING_EPS for p in params]
        temps = [1.0 if g else p.temperature for p, g in zip(params, greedy, strict=True)]
        top_ks = [vocab_size if p.top_k <= 0 else min(p.top_k, vocab_size) for p in params]
        banned = []
        for p, out in zip(params, output_token_ids, strict=True):
            if len(out) < p.min_tokens:
                ids = set(p.all_stop_token_ids) | set(p.stop_token_ids or ())
                if eos_token_id is not None and not p.ignore_eos:
                    ids.add(eos_token_id)
                banned.append(sorted(i for i in ids if 0 <= i < vocab_size))
            else:
                banned.append([])

        def f32(values: list[float]) -> Tensor:
            return torch.tensor(values, dtype=torch.float32, device=device)

        non_greedy = [p for p, g in zip(params, greedy, strict=True) if not g]
        return cls(
            temperatures=f32(temps),
            top_ps=f32([p.top_p for p in params]),
            top_ks=torch.tensor(top_ks, dtype=torch.int64, device=device),
            min_ps=f32([p.min_p for p in params]),
            presence_penalties=f32([p.presence_penalty for p in params]),
            frequency_penalties=f32([p.frequency_penalty for p in params]),
            repetition_penalties=f32([p.repetition_penalty for p in params]),
            greedy=torch.tensor(greedy, dtype=torch.bool, device=device),
            generators=list(generators),
            output_token_ids=[list(x) for x in output_token_ids],
            prompt_token_ids=[list(x) for x in prompt_token_ids],
            banned_token_ids=banned,
            num_logprobs=[p.logprobs for p in params],
            vocab_size=vocab_size,
            all_greedy=all(greedy),
            do_penalties=any(
                p.presence_penalty != 0.0
                or p.frequency_penalty != 0.0
                or p.repetition_penalty != 1.0
                for p in params
            ),
            do_top_k=any(k < vocab_size for k, g in zip(top_ks, greedy, strict=True) if not g),
            do_top_p=any(p.top_p < 1.0 for p in non_greedy),
            do_min_p=any(p.min_p > 0.0 for p in non_greedy),
        )


class Sampler:
    """Stateless: everything a step needs is in the SamplingBatch."""

    def __call__(self, logits: Tensor, batch: SamplingBatch) -> SamplerOutput:
        if logits.dim() != 2 or logits.shape[0] != len(batch.num_logprobs):
            raise ValueError(f"logits must be [N, V] with N={len(batch.num_logprobs)}")
        raw = logits
        # A float32 copy: every step below may then work in place without touching the caller's.
        logits = logits.to(torch.float32, copy=True)
        if batch.do_penalties:
            logits = apply_penalties(logits, batch)
        if any(batch.banned_token_ids):
            logits = apply_bans(logits, batch.banned_token_ids)

        tokens = logits.argmax(dim=-1) if batch.all_greedy else self._sample(logits, batch)
        token_list = tokens.tolist()
        return SamplerOutput(
            sampled_token_ids=token_list,
            logprobs=_sample_logprobs(raw, token_list, batch.num_logprobs),
        )

    def _sample(self, logits: Tensor, batch: SamplingBatch) -> Tensor:
        greedy_tokens = logits.argmax(dim=-1)
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


def apply_penalties(logits: Tensor, batch: SamplingBatch) -> Tensor:
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
    return probs.div_(q).argmax(dim=-1)


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
