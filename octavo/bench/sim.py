"""A model-free replay of a trace through the engine's scheduler and a KV allocator.

It isolates what the allocator decides: which requests fit at once. The scheduler is the
engine's own (engine/scheduler.py: schedule() then update_from_output() each step, as
engine.py drives it) over octavo's allocators (KVCacheManager, ContiguousAllocator), so the
admission, preemption and waste numbers are the engine's; only the model is missing. In its
place every sequence the plan samples gets token 0, and a request asks for exactly its trace
output_len tokens with ignore_eos, so it finishes at its output length.

The scheduler is set up so that memory alone limits it (EngineArgs names):
  - max_num_batched_tokens: unbounded (TOKEN_BUDGET), so a prompt, or a preempted request's
    recomputation, is admitted whole in one step and every running request decodes every step;
  - long_prefill_token_threshold = 0, max_num_partial_prefills = 0: no prompt is chunked and
    any number start in one step;
  - max_num_seqs: simulate()'s argument (1024, above what the budgets here hold);
  - scheduling_policy fcfs, arrival order = trace order; preemption_mode recompute (a
    preempted request's tokens so far are recomputed when it is admitted again);
  - enable_prefix_caching off: the traces share no prefixes, and a recomputation must not find
    its own freed blocks (what is measured is the allocator, not the cache).

What follows from the real scheduler, where the replay's numbers are defined by it:
  - Admission is FCFS while the head of the queue gets its blocks (head-of-line blocking).
    There is no free-block watermark (the engine has none): the paged allocator admits until a
    prompt does not fit, and running out of blocks mid-decode preempts the lowest-ranked
    running request (the latest arrival in the trace, not the last one admitted); in a step
    where that happened no request starts.
  - `preemptions` is the scheduler's num_preemptions (one per request preempted).
  - Running requests are counted after schedule(): the requests that compute in the step, the
    ones finishing in it included (the scheduler's peak_running_seqs counts the same). A step
    is loaded when requests were still waiting after schedule().
  - KV memory (the waste shares, max_seq_slots) is sampled between steps, where the engine's
    stats() sees it: after the step's finished requests gave their blocks back and sliding
    windows dropped what left them.

Contiguous baselines use 1-token blocks so that only their reservation policy (not a block
size) decides what they waste, and are told each sequence's final length, which only a replay
knows, so that their waste report tells reserved slots never to be used (internal) from those
still to come (reserved).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from octavo.bench.workloads import Workload, poisson_arrivals
from octavo.engine.request import Request
from octavo.engine.scheduler import Scheduler
from octavo.engine_args import EngineArgs
from octavo.paging import ContiguousAllocator, KVCacheManager, WasteTracker
from octavo.paging.allocator import CachedPrefix, NewBlocks
from octavo.paging.kv_audit import sliding_blocks_held
from octavo.paging.kv_seq import KVSeq
from octavo.paging.waste import SLOT_KEYS
from octavo.sampling_params import SamplingParams
from octavo.step_plan import RunnerOutput, StepPlan

ALLOCATORS = ("contiguous-max", "contiguous-request", "paged")
TOKEN_BUDGET = 1 << 40  # max_num_batched_tokens: never binds before memory does
SAMPLED_TOKEN = 0  # what the stand-in for the model samples (ids do not matter here)


class KnownLengthContiguous(ContiguousAllocator):
    """The contiguous baseline told each sequence's final length: its reservation's slots past
    prompt + output_len - 1 (the last sampled token never enters the cache) are internal
    waste from the start. The scheduler sets reserve_tokens = prompt + max_tokens, which is
    that length plus one for a request that runs to max_tokens, as every replayed one does."""

    def allocate_slots(self, seq: KVSeq, num_new_tokens: int, cached: CachedPrefix | None = None,
                       *, reserve_tokens: int | None = None, final_tokens: int | None = None,
                       num_lookahead_tokens: int = 0) -> NewBlocks | None:
        if final_tokens is None and seq.reserve_tokens is not None:
            final_tokens = seq.reserve_tokens - 1
        return super().allocate_slots(seq, num_new_tokens, cached, reserve_tokens=reserve_tokens,
                                      final_tokens=final_tokens,
                                      num_lookahead_tokens=num_lookahead_tokens)


def make_allocator(kind: str, *, kv_tokens: int, block_size: int, max_model_len: int,
                   window: int | None = None) -> KVCacheManager | ContiguousAllocator:
    """`kv_tokens` of KV memory cut into blocks, as engine/kv_sizing.py's make_kv_manager
    builds them for kv_allocator="paged" (no prefix caching, no host pool) or "contiguous"
    (contiguous_reserve max_model_len or request). `window`: a Mistral-style model whose every
    layer slides (paging frees what leaves the window; a contiguous reservation cannot)."""
    if kind == "paged":
        return KVCacheManager(kv_tokens // block_size, block_size, enable_prefix_caching=False,
                              windows=(window,))
    if kind in ("contiguous-max", "contiguous-request"):
        reserve = "max_model_len" if kind == "contiguous-max" else "request"
        return KnownLengthContiguous(kv_tokens, 1, max_model_len=max_model_len, reserve=reserve)
    raise ValueError(f"unknown allocator {kind!r}; one of {ALLOCATORS}")


def make_scheduler(kind: str, *, kv_tokens: int, block_size: int, max_model_len: int,
                   max_num_seqs: int = 1024, window: int | None = None,
                   **options: Any) -> Scheduler:
    """The engine's Scheduler over `kind`'s allocator, memory-bound (see the module docstring).
    `options`: EngineArgs scheduler options over those chosen here."""
    settings = {"max_num_seqs": max_num_seqs, "max_num_batched_tokens": TOKEN_BUDGET,
                "long_prefill_token_threshold": 0, "max_num_partial_prefills": 0,
                "scheduling_policy": "fcfs", "preemption_mode": "recompute",
                "enable_prefix_caching": False, **options}
    config = EngineArgs(**settings).scheduler_config(max_model_len)
    kv = make_allocator(kind, kv_tokens=kv_tokens, block_size=block_size,
                        max_model_len=max_model_len, window=window)
    return Scheduler(config, kv)


@dataclass
class SimResult:
    allocator: str
    block_size: int
    num_steps: int
    completed: int
    mean_running: float  # over every step until the last request finished
    loaded_running: float  # over the steps where requests were waiting: memory-bound
    peak_running: int
    preemptions: int
    requests_per_1k_steps: float  # over the whole replay (the drain tail included)
    loaded_requests_per_1k_steps: float  # completions while requests were waiting
    loaded_steps: int
    window: int | None  # every layer's sliding window (None: full attention)
    max_seq_slots: int  # the most KV slots one sequence held at the end of a step
    waste_of_total: dict[str, dict[str, float]]
    waste_of_used: dict[str, dict[str, float]]
    running_series: list[int] = field(default_factory=list)


def max_held_slots(scheduler: Scheduler) -> int:
    """The most KV slots one running sequence holds: its blocks (paging; a sliding window's
    only), or its whole reservation (contiguous)."""
    kv = scheduler.kv
    if isinstance(kv, KVCacheManager):
        if kv.windows[0] is not None:
            return sliding_blocks_held(kv) * kv.block_size
        return max((-(-s.num_computed_tokens // kv.block_size) * kv.block_size
                    for r in scheduler.running for s in r.live_seqs), default=0)
    return max((kv.reservation_blocks(0, s.reserve_tokens) * kv.block_size
                for r in scheduler.running for s in r.live_seqs), default=0)


def _occupied_only(stats: dict) -> dict:
    """The same shares with usable free memory left out: what fraction of the memory the
    requests hold is live (the vLLM paper's Fig. 2 denominator)."""
    return {**stats, SLOT_KEYS["free"]: 0}


def model_free_output(plan: StepPlan) -> RunnerOutput:
    """What the runner would return, without a model: one token for every sequence the plan
    samples (a prompt's last chunk, or a decode)."""
    return RunnerOutput(sampled_token_ids={
        seq_id: [SAMPLED_TOKEN] for chunk in plan.chunks for seq_id in chunk.sample_seq_ids})


def trace_requests(workload: Workload) -> list[Request]:
    """The trace's requests in arrival order, each running to its output length."""
    return [Request(str(i), None, list(r.prompt_token_ids),
                    SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True),
                    arrival_index=i)
            for i, r in enumerate(workload.requests)]


def _check_full_length(request: Request) -> None:
    seq = request.seqs[0]
    wanted = request.params.max_tokens
    if seq.num_output_tokens != wanted:
        raise ValueError(
            f"request {request.request_id} ({request.num_prompt_tokens} prompt + {wanted} "
            f"output tokens) finished after {seq.num_output_tokens} output tokens "
            f"({seq.finish_reason}): the KV cache cannot hold it even alone")


def replay(scheduler: Scheduler, workload: Workload, allocator: str, *,
           arrival_rate: float = math.inf, seed: int = 0,
           series_points: int = 400) -> SimResult:
    """Replay `workload` through `scheduler` (make_scheduler's) until every request finished;
    `arrival_rate` is in requests per step (inf: all arrive at once)."""
    kv = scheduler.kv
    kv_slots = kv.num_blocks * kv.block_size
    arrivals = poisson_arrivals(len(workload), arrival_rate, seed)
    pending = trace_requests(workload)
    total_of = WasteTracker()
    used_of = WasteTracker()
    running_counts: list[int] = []
    loaded_counts: list[int] = []
    completed = step = loaded_completed = max_seq_slots = 0
    nxt = 0
    while nxt < len(pending) or scheduler.has_unfinished():
        while nxt < len(pending) and arrivals[nxt] <= step:
            scheduler.add_request(pending[nxt])  # arrivals come in trace order: already sorted
            nxt += 1
        plan = scheduler.schedule()
        running = len(scheduler.running)
        loaded = bool(scheduler.waiting)
        for update in scheduler.update_from_output(plan, model_free_output(plan)):
            if update.request.is_finished:
                _check_full_length(update.request)
                completed += 1
                loaded_completed += loaded
        max_seq_slots = max(max_seq_slots, max_held_slots(scheduler))
        stats = kv.stats()
        total_of.sample(stats)
        occupied = kv_slots - stats[SLOT_KEYS["free"]]
        if occupied > 0:
            used_of.sample(_occupied_only(stats), weight=occupied)
        running_counts.append(running)
        if loaded:
            loaded_counts.append(running)
        step += 1
    kv.check_invariants()
    stride = max(1, len(running_counts) // series_points)
    counters = scheduler.stats()
    return SimResult(
        allocator=allocator,
        block_size=kv.block_size if isinstance(kv, KVCacheManager) else 0,
        num_steps=step,
        completed=completed,
        mean_running=sum(running_counts) / max(len(running_counts), 1),
        loaded_running=sum(loaded_counts) / max(len(loaded_counts), 1),
        peak_running=int(counters["peak_running_seqs"]),
        preemptions=int(counters["num_preemptions"]),
        requests_per_1k_steps=1000 * completed / max(step, 1),
        loaded_requests_per_1k_steps=1000 * loaded_completed / max(len(loaded_counts), 1),
        loaded_steps=len(loaded_counts),
        window=kv.windows[0] if isinstance(kv, KVCacheManager) else None,
        max_seq_slots=max_seq_slots,
        waste_of_total=total_of.summary(),
        waste_of_used=used_of.summary(),
        running_series=running_counts[::stride],
    )


def simulate(
    workload: Workload,
    kind: str,
    *,
    kv_tokens: int,
    block_size: int = 16,
    arrival_rate: float = math.inf,
    max_num_seqs: int = 1024,
    seed: int = 0,
    series_points: int = 400,
    window: int | None = None,
) -> SimResult:
    """Replay `workload` through the engine's scheduler over `kind`'s allocator (ALLOCATORS)
    with `kv_tokens` slots of KV memory; `arrival_rate` is in requests per step (inf: all
    arrive at once)."""
    scheduler = make_scheduler(kind, kv_tokens=kv_tokens, block_size=block_size,
                               max_model_len=workload.max_model_len,
                               max_num_seqs=max_num_seqs, window=window)
    return replay(scheduler, workload, kind, arrival_rate=arrival_rate, seed=seed,
                  series_points=series_points)
