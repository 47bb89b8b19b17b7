"""Drive octavo's engine directly over a workload, sampling its stats every step.

Benchmarks need more than LLM.generate gives: per-step running counts, block usage and the time
spent in the scheduler, so they call add_request / step themselves. Prefix caching is off unless
asked for: random prompts share nothing, and repeats must not hit the previous run's blocks.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from octavo.bench.workloads import Workload
from octavo.llm import LLM
from octavo.sampling_params import BeamSearchParams, SamplingParams


def effective_dtype(model: str | None, dtype: str,
                    overrides: dict[str, Any] | None = None) -> str:
    """The dtype octavo computes in when asked for `dtype` (auto, or a 16-bit dtype on a CPU
    without native bf16: model/dtype_policy.py), on the device and ISA the overrides choose."""
    import torch

    from octavo.config import ModelConfig
    from octavo.model.dtype_policy import resolve_isa_and_dtype
    from octavo.model.sources import resolve_model_dir

    overrides = overrides or {}
    device = torch.device(overrides.get("device") or "cpu")
    cfg = ModelConfig.from_dir(resolve_model_dir(model))
    return resolve_isa_and_dtype(overrides.get("cpu_isa"), dtype, cfg, device)[1].name


def make_llm(model: str | None, *, dtype: str = "float32", allocator: str = "paged",
             block_size: int = 16, overrides: dict[str, Any] | None = None,
             **kwargs: Any) -> LLM:
    """allocator: paged | contiguous-max | contiguous-request. `overrides` (engine options from
    the command line, BenchOptions.engine_overrides) win over everything else."""
    kv_allocator = "paged" if allocator == "paged" else "contiguous"
    reserve = "request" if allocator == "contiguous-request" else "max_model_len"
    kwargs.setdefault("enable_prefix_caching", False)
    options = dict(dtype=dtype, block_size=block_size, kv_allocator=kv_allocator,
                   contiguous_reserve=reserve, **kwargs)
    return LLM(model, **{**options, **(overrides or {})})


def greedy_params(output_len: int, n: int = 1, seed: int | None = None) -> SamplingParams:
    """Outputs forced to `output_len` tokens; sampled (temperature 1) when n > 1."""
    return SamplingParams(temperature=1.0 if n > 1 else 0.0, n=n, seed=seed,
                          max_tokens=output_len, ignore_eos=True, detokenize=False)


@dataclass
class EngineRun:
    elapsed_s: float
    steps: int
    output_tokens: int
    requests: int
    sched_s: float  # time inside scheduler.schedule()
    step_s: float  # time inside engine.step(), scheduler included
    samples: list[dict[str, float]] = field(default_factory=list)
    final_stats: dict[str, Any] = field(default_factory=dict)

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.elapsed_s

    @property
    def req_s(self) -> float:
        return self.requests / self.elapsed_s


def run_workload(
    llm: LLM,
    wl: Workload,
    *,
    n: int = 1,
    beam_width: int = 0,
    seed: int = 0,
    sample: Callable[[dict[str, Any]], dict[str, float]] | None = None,
    tag: str = "",
) -> EngineRun:
    """Add every request at once, step until done. `sample(stats)` picks what to keep per step
    (engine.stats() is only called when it is given: it walks every block table)."""
    engine = llm.engine
    sched = engine.scheduler
    cls_schedule = type(sched).schedule
    sched_time = [0.0]

    def timed_schedule():
        t = time.perf_counter()
        out = cls_schedule(sched)
        sched_time[0] += time.perf_counter() - t
        return out

    sched.schedule = timed_schedule  # type: ignore[method-assign]
    try:
        t0 = time.perf_counter()
        for i, r in enumerate(wl.requests):
            prompt = {"prompt_token_ids": list(r.prompt_token_ids)}
            rid = f"{tag}{i}"
            if beam_width:
                engine.add_request(rid, prompt, beam_params=BeamSearchParams(
                    beam_width=beam_width, max_tokens=r.output_len, ignore_eos=True))
            else:
                engine.add_request(rid, prompt, greedy_params(r.output_len, n, seed + i))
        steps = 0
        step_s = 0.0
        samples = []
        out_tokens = 0
        while engine.has_unfinished_requests():
            ts = time.perf_counter()
            outs = engine.step()
            step_s += time.perf_counter() - ts
            steps += 1
            for o in outs:
                if o.finished:
                    out_tokens += sum(len(c.token_ids) for c in o.outputs)
            if sample is not None:
                samples.append(sample(engine.stats()))
        elapsed = time.perf_counter() - t0
    finally:
        del sched.schedule
    return EngineRun(elapsed, steps, out_tokens, len(wl), sched_time[0], step_s, samples,
                     engine.stats())
