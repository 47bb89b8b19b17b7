"""The scheduler's admission: which swapped-out and waiting requests start running in a step.

After the running requests have their chunks (scheduler.py), requests swapped out earlier come
back, their blocks swapped in under new block ids, then waiting requests are admitted in rank
order while the token budget, `max_num_seqs` and `max_num_partial_prefills` allow: a waiting
request gets blocks for every one of its sequences (reusing its cached prefix, unless it asks
for prompt logprobs) or stays waiting. Under the priority policy a waiting request that
outranks a running one is admitted before that one is scheduled, preempting the lowest-ranked
running requests until it fits.

SchedulerAdmission is a part of Scheduler (scheduler.py), which inherits it: it works on the
scheduler's queues, puts chunks in the plan with the scheduler's `_emit`, and takes blocks back
with its `_preempt` (or gives up on a request that never fits, `_give_up`).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from typing import Any

from octavo.config import SchedulerConfig
from octavo.engine.request import Request, RequestStatus, Sequence
from octavo.paging.allocator import KVAllocator, NewBlocks
from octavo.step_plan import StepPlan

# (sequence, first token, number of tokens, what allocate_slots changed)
Slot = tuple[Sequence, int, int, NewBlocks]


class SchedulerAdmission:
    """Swapped-out and waiting requests into the running queue (a part of Scheduler)."""

    # the scheduler's state (Scheduler.__init__)
    config: SchedulerConfig
    kv: KVAllocator
    waiting: list[Request]
    running: list[Request]
    swapped: list[Request]
    _prefills_left: int
    _key: Callable[[Request], Any]

    # ---- max_num_seqs ---------------------------------------------------------------------
    @staticmethod
    def _seq_slots(request: Request) -> int:
        # Sequences a request takes under max_num_seqs: one not forked yet (still in its prompt)
        # will run max_seqs of them (n samples or beams), so count those from the start.
        return request.max_seqs if len(request.seqs) == 1 else len(request.live_seqs)

    def _num_seq_slots(self) -> int:
        return sum(self._seq_slots(r) for r in self.running)

    # ---- admission ------------------------------------------------------------------------
    def _admit_outranking(self, request: Request, plan: StepPlan, budget: int) -> tuple[int, int]:
        """Priority policy: before `request` is scheduled, admit the waiting requests that
        outrank it, preempting the lowest-ranked running requests while one does not fit.
        Returns the budget left and the number of preemptions."""
        preempted = 0
        while self.waiting and budget > 0 and self._key(self.waiting[0]) < self._key(request):
            head = self.waiting[0]
            left = self._admit(head, plan, budget)
            if left is not None:
                budget = left
                continue
            tail = self.running[-1]
            if self._key(tail) <= self._key(head):
                break
            self._preempt(tail, plan=plan)
            preempted += 1
            if tail is request:
                break
        return budget, preempted

    def _swap_in(self, plan: StepPlan, budget: int) -> int:
        while self.swapped and budget > 0:
            request = self.swapped[0]
            if self._num_seq_slots() + self._seq_slots(request) > self.config.max_num_seqs:
                break
            seqs = request.live_seqs
            copies = self.kv.swap_in([s.seq_id for s in seqs])
            if copies is None:
                break
            self.swapped.pop(0)
            plan.swap_in.extend(copies)
            request.status = RequestStatus.RUNNING
            bisect.insort(self.running, request, key=self._key)
            for seq in seqs:  # back on the device, under new block ids
                self._sync_runner(seq, None, plan)
            slots: list[Slot] = []
            for seq in seqs:
                n = min(seq.num_new_tokens, budget)
                start = seq.num_computed_tokens
                if n <= 0 or (new := self.kv.allocate_slots(seq, n)) is None:
                    break
                slots.append((seq, start, n, new))
                budget -= n
            for slot in slots:
                self._emit(request, *slot, plan)
        return budget

    def _admit_waiting(self, plan: StepPlan, budget: int) -> None:
        while self.waiting and budget > 0:
            request = self.waiting[0]
            left = self._admit(request, plan, budget)
            if left is not None:
                budget = left
                continue
            if not self.running and not self.swapped and not plan.chunks:
                # the whole cache is free and it still does not fit: it never will
                self.waiting.pop(0)
                self._give_up(request)
                continue
            break

    def _admit(self, request: Request, plan: StepPlan, budget: int) -> int | None:
        """Start a waiting request (its blocks and first chunk) and return the budget left, or
        None when it does not fit now."""
        max_seqs = max(len(request.live_seqs), request.max_seqs)
        if self.running and self._num_seq_slots() + max_seqs > self.config.max_num_seqs:
            return None
        if self._prefills_left <= 0:  # this step's prompts are taken (max_num_partial_prefills)
            return None
        slots = self._allocate(request, budget)
        if slots is None:
            return None
        if any(n for _, _, n, _ in slots):
            self._prefills_left -= 1
        assert self.waiting[0] is request
        self.waiting.pop(0)
        request.status = RequestStatus.RUNNING
        bisect.insort(self.running, request, key=self._key)
        for seq, start, n, new in slots:
            if n:
                self._emit(request, seq, start, n, new, plan)
                budget -= n
        return budget

    def _allocate(self, request: Request, budget: int) -> list[Slot] | None:
        """Blocks for every sequence of a waiting request, or none at all (returns None)."""
        use_cache = request.params.prompt_logprobs is None  # they need every position's logits
        reserve = self.reserve_tokens(request)
        done: list[Slot] = []
        for seq in request.live_seqs:
            seq.reserve_tokens = reserve  # the contiguous baseline reserves it up front
            cached = self.kv.get_computed_blocks(seq) if use_cache else None
            n = min(len(seq.token_ids) - (cached.num_tokens if cached else 0), budget)
            if self.config.long_prefill_token_threshold:
                n = min(n, self.config.long_prefill_token_threshold)
            new = None
            if n > 0:
                new = self.kv.allocate_slots(seq, n, cached)
            if new is None and done:
                # A later sequence of a forked request being recomputed. The earlier ones keep
                # their blocks (new full blocks are already in the prefix cache, so they must be
                # computed this step); this one takes its cached blocks now and computes the
                # rest in later steps, like a chunked prefill.
                n = 0
                new = self.kv.allocate_slots(seq, 0, cached)
            if new is None:
                for s, start, _, _ in done:
                    self.kv.uncache_from(s.seq_id, start)  # registered, never computed
                    self.kv.free(s.seq_id)
                return None
            done.append((seq, seq.num_computed_tokens - n, n, new))
            budget -= n
        if request.num_cached_tokens is None:  # vLLM's count: the first admission's hits
            request.num_cached_tokens = done[0][1] if done else 0
        return done

    def reserve_tokens(self, request: Request) -> int:
        """Prompt + max_tokens, capped at max_model_len: what a contiguous reservation holds."""
        return request.num_prompt_tokens + self._max_tokens(request)

    def _max_tokens(self, request: Request) -> int:
        limit = self.config.max_model_len - request.num_prompt_tokens
        mt = request.params.max_tokens
        return limit if mt is None else min(mt, limit)
