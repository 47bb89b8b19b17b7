"""The workloads every benchmark shares (DESIGN.md, "Workloads"): seeded, token-id prompts.

Prompts are random token ids, not text, so lengths are exact and no tokenizer is involved;
outputs are forced to their length with ignore_eos. Every generator takes a seed and returns the
same trace for the same arguments, so two engines (or two runs) always see identical requests.
Special tokens are avoided by drawing ids from the top 7/8 of the vocabulary.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field, replace

SMOLLM2_VOCAB = 49152

# ShareGPT's mean lengths (vLLM paper, Fig. 11) and Alpaca's.
SHAREGPT_MEAN_IN, SHAREGPT_MEAN_OUT = 161, 338
ALPACA_MEAN_IN, ALPACA_MEAN_OUT = 19, 58


@dataclass(frozen=True, slots=True)
class BenchRequest:
    prompt_token_ids: tuple[int, ...]
    output_len: int
    group: int = -1  # prefix workload: which shared prefix; -1 elsewhere

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def total_len(self) -> int:
        return self.prompt_len + self.output_len


@dataclass(frozen=True, slots=True)
class Workload:
    name: str
    requests: tuple[BenchRequest, ...]
    max_model_len: int
    params: dict = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def output_tokens(self) -> int:
        return sum(r.output_len for r in self.requests)

    @property
    def prompt_tokens(self) -> int:
        return sum(r.prompt_len for r in self.requests)

    def describe(self) -> dict:
        n = max(len(self.requests), 1)
        return {
            "name": self.name,
            "num_requests": len(self.requests),
            "mean_prompt_len": round(self.prompt_tokens / n, 1),
            "mean_output_len": round(self.output_tokens / n, 1),
            "max_total_len": max((r.total_len for r in self.requests), default=0),
            "max_model_len": self.max_model_len,
            **self.params,
        }

    def capped(self, max_output: int, max_prompt: int | None = None) -> Workload:
        """A cheaper variant for CPU runs: outputs (and prompts) cut to a maximum length."""
        reqs = tuple(
            replace(
                r,
                prompt_token_ids=r.prompt_token_ids[:max_prompt] if max_prompt else
                r.prompt_token_ids,
                output_len=min(r.output_len, max_output),
            )
            for r in self.requests
        )
        params = {**self.params, "output_capped_at": max_output}
        if max_prompt:
            params["prompt_capped_at"] = max_prompt
        return replace(self, requests=reqs, params=params)


def _ids(rng: random.Random, n: int, vocab: int) -> tuple[int, ...]:
    low = vocab // 8
    return tuple(rng.randrange(low, vocab) for _ in range(n))


def _lognormal(rng: random.Random, mean: float, sigma: float) -> float:
    """A lognormal draw with the given mean (mu = ln(mean) - sigma^2 / 2)."""
    return rng.lognormvariate(math.log(mean) - sigma * sigma / 2, sigma)


def mixed(num_requests: int = 64, *, output_len: int = 128, min_prompt: int = 32,
          max_prompt: int = 512, vocab: int = SMOLLM2_VOCAB, seed: int = 0,
          max_model_len: int = 2048) -> Workload:
    rng = random.Random(seed)
    reqs = tuple(
        BenchRequest(_ids(rng, rng.randint(min_prompt, max_prompt), vocab), output_len)
        for _ in range(num_requests)
    )
    return Workload("mixed", reqs, max_model_len, {"seed": seed})


def sharegpt(num_requests: int = 1000, *, mean_in: float = SHAREGPT_MEAN_IN,
             mean_out: float = SHAREGPT_MEAN_OUT, sigma_in: float = 1.0, sigma_out: float = 0.8,
             max_model_len: int = 2048, vocab: int = SMOLLM2_VOCAB, seed: int = 0,
             name: str = "sharegpt") -> Workload:
    """Lognormal input/output lengths with ShareGPT's means; a prompt keeps at most half the
    context and prompt + output fit in max_model_len (clipping lowers the means a little;
    describe() reports the real ones)."""
    rng = random.Random(seed)
    reqs = []
    for _ in range(num_requests):
        p = min(max(4, round(_lognormal(rng, mean_in, sigma_in))), max_model_len // 2)
        o = min(max(1, round(_lognormal(rng, mean_out, sigma_out))), max_model_len - p)
        reqs.append(BenchRequest(_ids(rng, p, vocab), o))
    return Workload(name, tuple(reqs), max_model_len,
                    {"seed": seed, "sigma_in": sigma_in, "sigma_out": sigma_out})


def alpaca(num_requests: int = 1000, *, vocab: int = SMOLLM2_VOCAB, seed: int = 0,
           max_model_len: int = 2048) -> Workload:
    """Short instructions and answers (Alpaca: input ~19, output ~58 tokens)."""
    return sharegpt(num_requests, mean_in=ALPACA_MEAN_IN, mean_out=ALPACA_MEAN_OUT,
                    sigma_in=0.6, sigma_out=0.7, max_model_len=max_model_len, vocab=vocab,
                    seed=seed, name="alpaca")


def prefix(num_groups: int = 4, per_group: int = 8, *, prefix_len: int = 512,
           suffix_len: int = 64, output_len: int = 32, vocab: int = SMOLLM2_VOCAB,
           seed: int = 0, max_model_len: int = 2048) -> Workload:
    """Groups sharing a long prefix (a system prompt, a few-shot block) plus a unique suffix;
    arrival order is shuffled, as requests of different tenants interleave."""
    rng = random.Random(seed)
    prefixes = [_ids(rng, prefix_len, vocab) for _ in range(num_groups)]
    reqs = [
        BenchRequest(prefixes[g] + _ids(rng, suffix_len, vocab), output_len, group=g)
        for g in range(num_groups)
        for _ in range(per_group)
    ]
    rng.shuffle(reqs)
    return Workload("prefix", tuple(reqs), max_model_len,
                    {"seed": seed, "num_groups": num_groups, "per_group": per_group,
                     "prefix_len": prefix_len, "suffix_len": suffix_len})


def case_study(num_requests: int = 1000, *, min_len: int = 200, max_len: int = 1000,
               max_model_len: int = 4096, vocab: int = SMOLLM2_VOCAB,
               seed: int = 0) -> Workload:
    """The seed's example: a 4096-token context limit, real requests of 200-1000 tokens
    (total length uniform; the prompt takes a uniform 25-75% of it)."""
    rng = random.Random(seed)
    reqs = []
    for _ in range(num_requests):
        total = rng.randint(min_len, max_len)
        p = max(1, round(total * rng.uniform(0.25, 0.75)))
        reqs.append(BenchRequest(_ids(rng, p, vocab), total - p))
    return Workload("case-study", tuple(reqs), max_model_len, {"seed": seed})


WORKLOADS: dict[str, Callable[..., Workload]] = {
    "mixed": mixed,
    "sharegpt": sharegpt,
    "prefix": prefix,
    "case-study": case_study,
    "alpaca": alpaca,
}


def make(name: str, **kwargs) -> Workload:
    try:
        return WORKLOADS[name](**kwargs)
    except KeyError:
        raise ValueError(f"unknown workload {name!r}; one of {sorted(WORKLOADS)}") from None


def poisson_arrivals(n: int, rate: float, seed: int = 0) -> list[float]:
    """Arrival times (seconds, or steps) of a Poisson process; rate=inf means all at once."""
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(t)
    return out
