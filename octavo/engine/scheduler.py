"""Iteration-level (continuous-batching) scheduler with chunked prefill and preemption.

Every step builds one batch under a token budget (``max_num_batched_tokens``) and a sequence cap
(``max_num_seqs``): running requests first (their decode tokens, or the next chunk of a prompt),
then requests swapped out earlier, then waiting prompts, a long prompt split over several steps.
When blocks run out, the lowest-ranked running request (last arrived, or lowest priority under
the priority policy) is preempted: its blocks are freed and it is recomputed later (cached prefix
blocks make that cheap), or its blocks are swapped out to the host pool and back in later.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from octavo.engine.request import Request, RequestStatus, Sequence
from octavo.paging.allocator import KVAllocator


@dataclass(slots=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 8192
    preemption_mode: str = "recompute"
    scheduling_policy: str = "fcfs"

    def __post_init__(self) -> None:
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(
                f"preemption_mode must be 'recompute' or 'swap', got {self.preemption_mode!r}"
            )
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(
                f"scheduling_policy must be 'fcfs' or 'priority', got {self.scheduling_policy!r}"
            )
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    start_pos: int
    num_new_tokens: int
    sample: bool  # the sequence catches up with its tokens: sample the next one
    prompt_logits: bool  # logits for every token (prompt logprobs)


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVAllocator) -> None:
        self.config = config
        self.kv = kv
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.swapped: list[Request] = []
        self.num_preemptions = 0
        # requests that can never fit the KV cache, finished by the scheduler; the engine
        # reports them (finish_reason "length") and empties this list
        self.ignored: list[Request] = []
        self.peak_running_seqs = 0
        if config.scheduling_policy == "priority":
            self._key = lambda r: r.sort_key
        else:
            self._key = lambda r: r.arrival_index

    # ---- queues ---------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        bisect.insort(self.waiting, request, key=self._key)

    def remove_request(self, request: Request) -> None:
        """Take a request out of whatever queue holds it and free all its blocks (abort)."""
        for queue in (self.waiting, self.running, self.swapped):
            if request in queue:
                queue.remove(request)
        for seq in request.seqs:
            self.kv.free(seq.seq_id)

    def finish_seq(self, seq: Sequence) -> None:
        self.kv.free(seq.seq_id)
        request = seq.request
        if request.is_finished and request in self.running:
            self.running.remove(request)
            request.status = RequestStatus.FINISHED

    def finish_request(self, request: Request) -> None:
        """Free every sequence of a request that ended as a whole (beam search)."""
        for seq in request.seqs:
            self.kv.free(seq.seq_id)
        if request in self.running:
            self.running.remove(request)
        request.status = RequestStatus.FINISHED

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    @property
    def num_running_seqs(self) -> int:
        return sum(len(r.live_seqs) for r in self.running)

    @staticmethod
    def _seq_slots(request: Request) -> int:
        # Sequences a request takes under max_num_seqs: one not forked yet (still in its prompt)
        # will run max_seqs of them (n samples or beams), so count those from the start.
        return request.max_seqs if len(request.seqs) == 1 else len(request.live_seqs)

    def _num_seq_slots(self) -> int:
        return sum(self._seq_slots(r) for r in self.running)

    # ---- one step -------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        if self.config.scheduling_policy == "priority":
            self._preempt_for_priority(out, budget)
        priority_preemptions = len(out.preempted)
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            plan = self._chunk_plan(request, budget)
            while not self._fits(plan):
                if self.running[-1] is not request:
                    self._preempt(self.running[-1], out)
                    continue
                # Nothing ranks below it. Its sequences (n samples, beams) need not all advance
                # together: run those that fit, the others wait for blocks. Only when not even
                # one fits is it preempted; alone, by recompute, which re-admits one sequence
                # at a time, so it always makes progress.
                plan = self._fitting_prefix(plan)
                if not plan:
                    self._preempt(request, out, recompute=len(self.running) == 1)
                break
            if request.status is not RequestStatus.RUNNING:
                break  # it was the last running request and preempted itself
            budget -= self._commit(request, plan, out)
            i += 1

        # After running requests had to give up blocks this step, nothing new starts: it would
        # only be preempted again. Swapped requests come back before waiting ones that rank
        # after them.
        memory_preempted = len(out.preempted) > priority_preemptions
        if not memory_preempted:
            budget = self._swap_in(out, budget)
        if not memory_preempted and (
            not self.swapped
            or (self.waiting and self._key(self.waiting[0]) < self._key(self.swapped[0]))
        ):
            self._admit_waiting(out, budget)
        out.block_copies = self.kv.take_block_copies()
        self.peak_running_seqs = max(self.peak_running_seqs, self.num_running_seqs)
        return out

    def _preempt_for_priority(self, out: SchedulerOutput, budget: int) -> None:
        """Under the priority policy a waiting request that outranks running ones takes their
        place: the lowest-ranked running requests are preempted (before anything is scheduled
        this step) until it fits."""
        while self.waiting and self.running:
            head, tail = self.waiting[0], self.running[-1]
            if self._key(tail) <= self._key(head) or self._can_admit(head, budget):
                return
            self._preempt(tail, out)

    def _can_admit(self, request: Request, budget: int) -> bool:
        if self._num_seq_slots() + self._seq_slots(request) > self.config.max_num_seqs:
            return False
        seq = request.live_seqs[0]
        use_cache = request.params.prompt_logprobs is None
        cached = self.kv.find_cached_prefix(seq.token_ids, request.cache_salt) if use_cache else 0
        n = min(len(seq.token_ids) - cached, budget)
        return self.kv.can_allocate(
            seq.token_ids, n, request.cache_salt,
            reserve_tokens=request.num_prompt_tokens + self._max_tokens(request),
            use_prefix_cache=use_cache,
        )

    def _chunk_plan(self, request: Request, budget: int) -> list[tuple[Sequence, int]]:
        plan = []
        for seq in request.live_seqs:
            n = min(seq.num_new_tokens, budget)
            if n > 0:
                plan.append((seq, n))
                budget -= n
        return plan

    def _fitting_prefix(self, plan: list[tuple[Sequence, int]]) -> list[tuple[Sequence, int]]:
        free = self.kv.num_free_blocks()
        for i, (seq, n) in enumerate(plan):
            free -= self.kv.num_blocks_needed(seq.seq_id, n)
            if free < 0:
                return plan[:i]
        return plan

    def _fits(self, plan: list[tuple[Sequence, int]]) -> bool:
        need = sum(self.kv.num_blocks_needed(seq.seq_id, n) for seq, n in plan)
        return need <= self.kv.num_free_blocks()

    def _commit(self, request: Request, plan, out: SchedulerOutput) -> int:
        for seq, n in plan:
            start = seq.num_computed_tokens
            self.kv.append_slots(seq.seq_id, seq.token_ids, n)
            out.scheduled.append(self._scheduled(request, seq, start, n))
        return sum(n for _, n in plan)

    @staticmethod
    def _scheduled(request: Request, seq: Sequence, start: int, n: int) -> ScheduledSeq:
        wants_prompt_logprobs = (
            request.params.prompt_logprobs is not None
            and start < seq.num_prompt_tokens
            and seq.index == 0
            and (request.prompt_logprobs is None
                 or len(request.prompt_logprobs) < seq.num_prompt_tokens)
        )
        return ScheduledSeq(
            seq=seq,
            start_pos=start,
            num_new_tokens=n,
            sample=start + n == len(seq.token_ids),
            prompt_logits=wants_prompt_logprobs,
        )

    def _give_up(self, request: Request) -> None:
        """Finish a request that cannot fit the KV cache even alone; the engine reports it."""
        if request in self.running:
            self.running.remove(request)
        for seq in request.seqs:
            self.kv.free(seq.seq_id)
        request.status = RequestStatus.FINISHED
        self.ignored.append(request)

    def _preempt(self, victim: Request, out: SchedulerOutput, recompute: bool = False) -> None:
        self.running.remove(victim)
        victim.num_preemptions += 1
        self.num_preemptions += 1
        out.preempted.append(victim)
        seq_ids = [s.seq_id for s in victim.live_seqs]
        swap = self.config.preemption_mode == "swap" and not recompute
        if swap and self.kv.can_swap_out(seq_ids):
            out.swap_out.extend(self.kv.swap_out(seq_ids))
            victim.status = RequestStatus.SWAPPED
            bisect.insort(self.swapped, victim, key=self._key)
            return
        for seq in victim.live_seqs:
            self.kv.free(seq.seq_id)
            seq.num_computed_tokens = 0
        victim.status = RequestStatus.WAITING
        bisect.insort(self.waiting, victim, key=self._key)

    def _swap_in(self, out: SchedulerOutput, budget: int) -> int:
        while self.swapped and budget > 0:
            request = self.swapped[0]
            seqs = request.live_seqs
            if self._num_seq_slots() + self._seq_slots(request) > self.config.max_num_seqs:
                break
            seq_ids = [s.seq_id for s in seqs]
            if not self.kv.can_swap_in(seq_ids):
                break
            self.swapped.pop(0)
            out.swap_in.extend(self.kv.swap_in(seq_ids))
            request.status = RequestStatus.RUNNING
            bisect.insort(self.running, request, key=self._key)
            plan = self._chunk_plan(request, budget)
            if self._fits(plan):
                budget -= self._commit(request, plan, out)
        return budget

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0:
            request = self.waiting[0]
            seqs = request.live_seqs
            max_seqs = max(len(seqs), request.max_seqs)
            if self.running and self._num_seq_slots() + max_seqs > self.config.max_num_seqs:
                break
            admitted = self._allocate(request, seqs, budget)
            if admitted is None:
                if not self.running and not self.swapped and not out.scheduled:
                    # the whole cache is free and it still does not fit: it never will
                    self.waiting.pop(0)
                    self._give_up(request)
                    continue
                break
            self.waiting.pop(0)
            request.status = RequestStatus.RUNNING
            bisect.insort(self.running, request, key=self._key)
            for seq, start, n in admitted:
                if n:
                    out.scheduled.append(self._scheduled(request, seq, start, n))
                    budget -= n

    def _allocate(self, request: Request, seqs: list[Sequence], budget: int):
        """Allocate blocks for every sequence of a waiting request, or none (returns None)."""
        use_cache = request.params.prompt_logprobs is None
        salt = request.cache_salt
        reserve = request.num_prompt_tokens + self._max_tokens(request)
        done: list[tuple[Sequence, int, int]] = []
        for seq in seqs:
            cached = self.kv.find_cached_prefix(seq.token_ids, salt) if use_cache else 0
            n = min(len(seq.token_ids) - cached, budget)

            def fits(num: int, seq: Sequence = seq) -> bool:
                return self.kv.can_allocate(
                    seq.token_ids, num, salt, reserve_tokens=reserve, use_prefix_cache=use_cache
                )

            if done and (n <= 0 or not fits(n)):
                # A later sequence of a forked request being recomputed. The earlier ones keep
                # their blocks (new full blocks are already in the prefix cache, so they must be
                # computed this step); this one takes its cached blocks now and computes the
                # rest in later steps, like a chunked prefill.
                n = 0
            if (n <= 0 and not done) or not fits(n):
                for s, start, _ in done:
                    self.kv.uncache_from(s.seq_id, start)  # registered, never computed
                    self.kv.free(s.seq_id)
                    s.num_computed_tokens = 0
                return None
            computed = self.kv.allocate(
                seq.seq_id, seq.token_ids, n, salt,
                use_prefix_cache=use_cache, reserve_tokens=reserve,
            )
            if n:
                n = min(len(seq.token_ids) - computed, budget)
            seq.num_computed_tokens = computed
            done.append((seq, computed, n))
            budget -= n
        return done

    def _max_tokens(self, request: Request) -> int:
        limit = self.config.max_model_len - request.num_prompt_tokens
        mt = request.params.max_tokens
        return limit if mt is None else min(mt, limit)
