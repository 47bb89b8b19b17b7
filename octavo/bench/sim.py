"""A model-free scheduler that replays a trace through a KV allocator, one decode step at a time.

It isolates what the allocator decides: which requests fit at once. Admission is FCFS while
the allocator gives the head its slots (head-of-line blocking, as in the engine); every running
sequence takes one slot per step for the token it produced last; a sequence frees everything
when it finishes. The paged allocator reserves nothing ahead, so it can run out of blocks
mid-decode: then, as the engine does, the last-admitted sequence is preempted and recomputed
later (its tokens so far become its prompt). A 1% free-block watermark at admission keeps that
rare, like vLLM's.

The allocators are octavo's own (KVCacheManager, ContiguousAllocator), so the waste numbers are
the same accounting the engine reports in stats(); only the model is missing.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field

from octavo.bench.workloads import Workload, poisson_arrivals
from octavo.paging import ContiguousAllocator, KVCacheManager, KVSeq, WasteTracker
from octavo.paging.kv_audit import sliding_blocks_held
from octavo.paging.waste import SLOT_KEYS

ALLOCATORS = ("contiguous-max", "contiguous-request", "paged")


def make_allocator(kind: str, *, kv_tokens: int, block_size: int, max_model_len: int,
                   window: int | None = None):
    """`kv_tokens` of KV memory cut into blocks; contiguous baselines use 1-token blocks so that
    only their reservation policy (not a block size) decides what they waste. `window`: a
    Mistral-style model whose every layer slides (paging frees what leaves the window; a
    contiguous reservation cannot)."""
    if kind == "paged":
        return KVCacheManager(kv_tokens // block_size, block_size, enable_prefix_caching=False,
                              windows=(window,))
    if kind in ("contiguous-max", "contiguous-request"):
        reserve = "max_model_len" if kind == "contiguous-max" else "request"
        return ContiguousAllocator(kv_tokens, 1, max_model_len=max_model_len, reserve=reserve)
    raise ValueError(f"unknown allocator {kind!r}; one of {ALLOCATORS}")


@dataclass(slots=True)
class _Seq:
    index: int  # position in the trace: FCFS order
    prompt_len: int
    output_len: int
    generated: int = 0
    kv: KVSeq | None = None  # its tokens as the allocator sees them, while it runs
    reserved_slots: int = 0  # a contiguous reservation's size, while it runs


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


def max_held_slots(kv, running: list[_Seq]) -> int:
    """The most KV slots one running sequence holds: its blocks (paging; a sliding window's
    only), or its whole reservation (contiguous)."""
    if isinstance(kv, KVCacheManager):
        if kv.windows[0] is not None:
            return sliding_blocks_held(kv) * kv.block_size
        return max((-(-s.kv.num_computed_tokens // kv.block_size) * kv.block_size
                    for s in running if s.kv is not None), default=0)
    return max((s.reserved_slots for s in running), default=0)


def _occupied_only(stats: dict) -> dict:
    """The same shares with usable free memory left out: what fraction of the memory the
    requests hold is live (the vLLM paper's Fig. 2 denominator)."""
    return {**stats, SLOT_KEYS["free"]: 0}


def simulate(
    workload: Workload,
    kind: str,
    *,
    kv_tokens: int,
    block_size: int = 16,
    arrival_rate: float = math.inf,
    max_num_seqs: int = 1024,
    seed: int = 0,
    watermark: float = 0.01,
    series_points: int = 400,
    window: int | None = None,
) -> SimResult:
    """Replay `workload`; `arrival_rate` is in requests per step (inf: all arrive at once)."""
    kv = make_allocator(kind, kv_tokens=kv_tokens, block_size=block_size,
                        max_model_len=workload.max_model_len, window=window)
    paged = kind == "paged"
    wm_blocks = math.ceil(watermark * kv.num_blocks) if paged else 0
    bs = kv.block_size
    arrivals = poisson_arrivals(len(workload), arrival_rate, seed)
    pending = [_Seq(i, r.prompt_len, r.output_len) for i, r in enumerate(workload.requests)]
    waiting: list[_Seq] = []
    running: list[_Seq] = []
    total_of = WasteTracker()
    used_of = WasteTracker()
    running_counts: list[int] = []
    loaded_counts: list[int] = []
    preemptions = completed = step = loaded_completed = max_seq_slots = 0
    nxt = 0
    while nxt < len(pending) or waiting or running:
        while nxt < len(pending) and arrivals[nxt] <= step:
            waiting.append(pending[nxt])  # arrivals come in trace order: already sorted
            nxt += 1
        # decode: one slot per running sequence for its last token; preempt the newest if full
        i = 0
        while i < len(running):
            seq = running[i]
            assert seq.kv is not None
            seq.kv.append_token(0)  # the token it produced last step (ids do not matter here)
            while kv.allocate_slots(seq.kv, 1) is None:
                victim = running.pop()
                kv.free(victim.index)
                victim.kv = None
                bisect.insort(waiting, victim, key=lambda s: s.index)
                preemptions += 1
                if victim is seq:
                    break
            else:
                seq.generated += 1
                i += 1
        # admit FCFS while the head fits
        while waiting and len(running) < max_num_seqs:
            seq = waiting[0]
            known = seq.prompt_len + seq.generated  # a recomputed sequence re-prefills all
            if paged and kv.num_free_blocks() - -(-known // bs) < wm_blocks and running:
                break
            tokens = KVSeq(seq.index, range(known),
                           reserve_tokens=seq.prompt_len + seq.output_len)
            # the baseline's waste report tells reserved slots never used from those to come
            final = {} if paged else {"final_tokens": seq.prompt_len + seq.output_len - 1}
            if kv.allocate_slots(tokens, known, **final) is None:
                break
            seq.kv = tokens
            if not paged:
                seq.reserved_slots = len(kv.block_table(seq.index)) * bs
            waiting.pop(0)
            running.append(seq)
            seq.generated += 1
        if window is not None:
            for seq in running:  # the step is done: what left the window goes back
                kv.free_out_of_window(seq.index)
        max_seq_slots = max(max_seq_slots, max_held_slots(kv, running))
        stats = kv.stats()
        total_of.sample(stats)
        occupied = kv_tokens - stats[SLOT_KEYS["free"]]
        if occupied > 0:
            used_of.sample(_occupied_only(stats), weight=occupied)
        running_counts.append(len(running))
        if waiting:
            loaded_counts.append(len(running))
        still = []
        for seq in running:
            if seq.generated >= seq.output_len:
                kv.free(seq.index)
                completed += 1
                loaded_completed += bool(waiting)
            else:
                still.append(seq)
        running = still
        step += 1
    kv.check_invariants()
    stride = max(1, len(running_counts) // series_points)
    return SimResult(
        allocator=kind,
        block_size=bs if paged else 0,
        num_steps=step,
        completed=completed,
        mean_running=sum(running_counts) / max(len(running_counts), 1),
        loaded_running=sum(loaded_counts) / max(len(loaded_counts), 1),
        peak_running=max(running_counts, default=0),
        preemptions=preemptions,
        requests_per_1k_steps=1000 * completed / max(step, 1),
        loaded_requests_per_1k_steps=1000 * loaded_completed / max(len(loaded_counts), 1),
        loaded_steps=len(loaded_counts),
        window=window,
        max_seq_slots=max_seq_slots,
        waste_of_total=total_of.summary(),
        waste_of_used=used_of.summary(),
        running_series=running_counts[::stride],
    )
