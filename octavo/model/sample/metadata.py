"""SamplingMetadata: one step's per-row sampling settings as tensors, the sampler's only input
besides the logits.

The runner builds it each step from what it keeps of each sequence (its SamplingParams, tokens
and output index); the sampler itself never sees a SamplingParams. Seeded rows get a generator
derived from (seed, output index, tokens generated so far): the same draw for the same position
whatever else is batched with it, after a preemption and recompute too, and a different stream
for each of the n parallel samples of one request.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from octavo.model.sample.reasoning_budget import forced_reasoning_token
from octavo.sampling_params import SAMPLING_EPS, SamplingParams


def seeded_generator(seed: int, index: int, num_output_tokens: int,
                     device: torch.device | str = "cpu") -> torch.Generator:
    gen = torch.Generator(device=device)
    gen.manual_seed(hash((seed, index, num_output_tokens)) & (2**63 - 1))
    return gen


@dataclass
class SamplingMetadata:
    temperatures: Tensor  # [N] float32; 1.0 for greedy rows (never divided by zero)
    top_ps: Tensor  # [N] float32
    top_ks: Tensor  # [N] int64; vocab_size when disabled
    min_ps: Tensor  # [N] float32
    presence_penalties: Tensor  # [N] float32
    frequency_penalties: Tensor  # [N] float32
    repetition_penalties: Tensor  # [N] float32
    greedy: Tensor  # [N] bool
    generators: list[torch.Generator | None]  # None = global RNG
    output_token_ids: list[list[int]]  # filled only when some row has penalties
    prompt_token_ids: list[list[int]]  # filled only when some row has penalties
    banned_token_ids: list[list[int]]  # EOS/stop ids suppressed this step (min_tokens)
    # (row, token id, bias) of every logit_bias entry of the batch
    logit_bias: tuple[list[int], list[int], list[float]] | None
    num_logprobs: list[int | None]
    vocab_size: int
    # (rows, allowed [len(rows), V] bool): tokens those rows may sample (structured outputs'
    # grammar bitmask and allowed_token_ids); every other row may sample any token
    allowed: tuple[Tensor, Tensor] | None = None
    # (row, token id): rows whose reasoning budget is spent sample this token (the next of
    # the end-of-thinking marker), if the other constraints allow it
    forced: list[tuple[int, int]] = field(default_factory=list)
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
        token_ids: Sequence[Sequence[int]],
        num_prompt_tokens: Sequence[int],
        vocab_size: int,
        *,
        indices: Sequence[int] | None = None,
        device: torch.device | str = "cpu",
        grammar: tuple[list[int], np.ndarray] | None = None,
    ) -> SamplingMetadata:
        """Gather the rows' settings into tensors. Row r's sequence holds `token_ids[r]`, the
        first `num_prompt_tokens[r]` of them its prompt; `indices`: each row's output index
        among its request's n (0 when omitted). EOS is banned with the stop ids while a row
        has fewer than min_tokens outputs when the engine recorded it in the params
        (SamplingParams.update_from_tokenizer); a bad word's last token is banned where the
        output ends with the rest of it. `grammar`: (rows, uint8 [rows, vocab] allowed tokens)
        of the structured-output rows."""
        n = len(params)
        if not (len(token_ids) == len(num_prompt_tokens) == n):
            raise ValueError("params, token_ids and num_prompt_tokens differ in length")
        indices = indices if indices is not None else [0] * n
        num_outputs = [len(t) - p for t, p in zip(token_ids, num_prompt_tokens, strict=True)]
        generators = [
            None if p.seed is None else seeded_generator(p.seed, i, k, device)
            for p, i, k in zip(params, indices, num_outputs, strict=True)
        ]
        greedy = [p.temperature < SAMPLING_EPS for p in params]
        temps = [1.0 if g else p.temperature for p, g in zip(params, greedy, strict=True)]
        top_ks = [vocab_size if p.top_k <= 0 else min(p.top_k, vocab_size) for p in params]
        banned = [
            sorted(i for i in p.all_stop_token_ids if 0 <= i < vocab_size)
            if k < p.min_tokens else []
            for p, k in zip(params, num_outputs, strict=True)
        ]
        for row, (p, t, k) in enumerate(zip(params, token_ids, num_prompt_tokens, strict=True)):
            if p.bad_words_token_ids:
                banned[row] = banned[row] + bad_word_bans(p.bad_words_token_ids, t[k:])
        bias_rows: list[int] = []
        bias_ids: list[int] = []
        bias_values: list[float] = []
        for row, p in enumerate(params):
            for token_id, bias in (p.logit_bias or {}).items():
                bias_rows.append(row)
                bias_ids.append(token_id)
                bias_values.append(bias)
        forced = []
        for row, (p, t, k) in enumerate(zip(params, token_ids, num_prompt_tokens, strict=True)):
            if p.thinking_token_budget is not None:
                token = forced_reasoning_token(p, t, k)
                if token is not None and 0 <= token < vocab_size:
                    forced.append((row, token))
        do_penalties = any(
            p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 or p.repetition_penalty != 1.0
            for p in params
        )

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
            generators=generators,
            output_token_ids=[list(t[k:]) for t, k in zip(token_ids, num_prompt_tokens,
                                                          strict=True)] if do_penalties else [],
            prompt_token_ids=[list(t[:k]) for t, k in zip(token_ids, num_prompt_tokens,
                                                          strict=True)] if do_penalties else [],
            banned_token_ids=banned,
            logit_bias=(bias_rows, bias_ids, bias_values) if bias_rows else None,
            num_logprobs=[p.logprobs for p in params],
            vocab_size=vocab_size,
            all_greedy=all(greedy),
            do_penalties=do_penalties,
            do_top_k=any(k < vocab_size for k, g in zip(top_ks, greedy, strict=True) if not g),
            do_top_p=any(p.top_p < 1.0 for p in non_greedy),
            do_min_p=any(p.min_p > 0.0 for p in non_greedy),
            allowed=token_masks(params, vocab_size, grammar, device),
            forced=forced,
        )


def bad_word_bans(bad_words: list[list[int]], output: Sequence[int]) -> list[int]:
    """Last tokens of the bad words whose other tokens end the output (vLLM's rule: only the
    output counts, not the prompt)."""
    bans = []
    for word in bad_words:
        prefix = word[:-1]
        if len(prefix) > len(output):
            continue
        if not prefix or list(output[len(output) - len(prefix):]) == prefix:
            bans.append(word[-1])
    return bans


def token_masks(params: Sequence[SamplingParams], vocab_size: int,
                grammar: tuple[list[int], np.ndarray] | None,
                device: torch.device | str) -> tuple[Tensor, Tensor] | None:
    """(rows, allowed [rows, vocab] bool) of the rows limited by a grammar (`grammar`: their
    rows and uint8 [rows, vocab] allowed bytes) or by allowed_token_ids."""
    limited = [r for r, p in enumerate(params) if p.allowed_token_ids]
    grammar_rows = grammar[0] if grammar is not None else []
    if grammar is not None and grammar_rows and not limited and grammar_rows == sorted(
            set(grammar_rows)):
        # the common case: the grammar's bytes are the mask as they are (a zero-copy view)
        allowed = torch.from_numpy(grammar[1]).view(torch.bool)
        return (torch.tensor(grammar_rows, dtype=torch.long, device=device), allowed.to(device))
    rows = sorted(set(limited) | set(grammar_rows))
    if not rows:
        return None
    position = {r: i for i, r in enumerate(rows)}
    allowed = torch.ones((len(rows), vocab_size), dtype=torch.bool)
    if grammar is not None and grammar_rows:
        index = torch.tensor([position[r] for r in grammar_rows], dtype=torch.long)
        allowed[index] = torch.from_numpy(grammar[1]).view(torch.bool)
    for r in limited:
        only = torch.zeros(vocab_size, dtype=torch.bool)
        only[[t for t in params[r].allowed_token_ids if t < vocab_size]] = True
        allowed[position[r]] &= only
    return (torch.tensor(rows, dtype=torch.long, device=device), allowed.to(device))
