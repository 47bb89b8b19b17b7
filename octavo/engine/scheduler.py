"""Iteration-level (continuous-batching) scheduler with chunked prefill and preemption.

Two calls a step, around the runner: `schedule()` builds the StepPlan, `update_from_output()`
takes what the runner sampled and moves the sequences on.

Every step builds one batch under a token budget (``max_num_batched_tokens``) and a sequence cap
(``max_num_seqs``): running requests first, in rank order (their decode tokens, or the next
chunk of a prompt), then requests swapped out earlier, then waiting prompts, a long prompt split
over several steps. A running prompt's chunk leaves the budget the decodes ranked after it need:
a long prefill never starves a stream of its next token. `long_prefill_token_threshold` caps one
prompt's chunk per step and `max_num_partial_prefills` the prompts in one step (vLLM's names),
which keeps steps short while prompts arrive: what protects time per output token. When blocks
run out, the lowest-ranked running request (last arrived, or lowest priority under the priority
policy) is preempted: its blocks are freed and it is recomputed later (cached prefix blocks make
that cheap), or its blocks are swapped out to the host pool and back in later. Under the
priority policy a waiting request that outranks running ones is admitted before them, preempting
the lowest-ranked until it fits.
"""

from __future__ import annotations

import bisect
import logging
import time

from octavo.config import SchedulerConfig
from octavo.engine import beam_search
from octavo.engine.output_processor import TextStop
from octavo.engine.parallel_sampling import fan_out, needs_fan_out
from octavo.engine.request import Request, RequestStatus, RequestUpdate, Sequence, SeqUpdate
from octavo.engine.speculator import DraftState, Speculator
from octavo.engine.stop_checker import check_token_stop
from octavo.paging.allocator import KVAllocator, NewBlocks
from octavo.step_plan import NewSeq, RunnerOutput, SeqChunk, StepPlan

logger = logging.getLogger(__name__)

# (sequence, first token, number of tokens, what allocate_slots changed)
Slot = tuple[Sequence, int, int, NewBlocks]


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVAllocator) -> None:
        self.config = config
        self.kv = kv
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.swapped: list[Request] = []
        self.seqs: dict[int, Sequence] = {}  # every live sequence, by id
        self.num_preemptions = 0
        self.peak_running_seqs = 0
        self.num_prompt_tokens_total = 0
        self.num_generation_tokens_total = 0
        self._dropped: list[int] = []  # sequences the runner must forget at the next step
        self._swap_out: list[tuple[int, int]] = []  # this step's preemptions by swapping
        # requests that can never fit the KV cache, finished by schedule() and reported by the
        # next update_from_output (finish_reason "length")
        self._ignored: list[Request] = []
        self._prefills_left = 0  # prompts this step may still take (see schedule)
        self.speculator = (None if config.speculative is None
                           else Speculator(config.speculative, config.max_model_len))
        if config.scheduling_policy == "priority":
            self._key = lambda r: r.sort_key
        else:
            self._key = lambda r: r.arrival_index

    # ---- queues ---------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        for seq in request.seqs:
            self.seqs[seq.seq_id] = seq
        bisect.insort(self.waiting, request, key=self._key)

    def abort_request(self, request: Request) -> None:
        """Take a request out of whatever queue holds it and free all its blocks at once."""
        for queue in (self.waiting, self.running, self.swapped, self._ignored):
            if request in queue:
                queue.remove(request)
        for seq in request.seqs:
            if not seq.is_finished:
                seq.finish_reason = "abort"
            self._release(seq)
        request.status = RequestStatus.FINISHED

    def apply_text_stops(self, stops: list[TextStop]) -> None:
        """Finish the sequences the output processor's stop strings ended (found after
        detokenizing): their finish and stop reasons, the tokens sampled past the stop in a
        step of several dropped, their blocks freed if they still ran."""
        for stop in stops:
            seq = stop.seq
            still_running = seq.finish_reason is None
            seq.drop_last_tokens(stop.drop_tokens)
            seq.finish_reason = stop.decision.finish_reason
            seq.stop_reason = stop.decision.stop_reason
            if still_running:
                self._finish_seq(seq)

    def set_draft_token_share(self, share: float) -> None:
        """The runner's drafter's cost per draft token, as a share of a target token's (its
        cost model needs it; speculative decoding with a model drafter only)."""
        if self.speculator is not None:
            self.speculator.draft_token_share = share

    def observe_step_time(self, plan: StepPlan, seconds: float) -> None:
        """How long the runner took for `plan`: the speculator's cost model learns from it."""
        if self.speculator is not None and plan.chunks:
            self.speculator.cost.observe(
                plan.num_tokens, sum(len(c.sample_seq_ids) for c in plan.chunks), seconds)

    def stats(self) -> dict[str, int | float]:
        """Queues, preemptions and token totals (and speculative decoding's counters)."""
        s: dict[str, int | float] = {
            "num_requests_running": len(self.running),
            "num_requests_waiting": len(self.waiting),
            "num_requests_swapped": len(self.swapped),
            "num_preemptions": self.num_preemptions,
            "peak_running_seqs": self.peak_running_seqs,
            "prompt_tokens_total": self.num_prompt_tokens_total,
            "generation_tokens_total": self.num_generation_tokens_total,
        }
        if self.speculator is not None:
            s.update(self.speculator.stats.as_stats())
        return s

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def tier_flush_plan(self) -> StepPlan | None:
        """A plan that only copies out the blocks waiting for the KV tier (an idle engine runs
        it, so a finished request's blocks reach the tier without waiting for new work)."""
        if not self.kv.has_tier_saves():
            return None
        plan = StepPlan()
        plan.tier_saves, plan.tier_loads = self.kv.take_tier_io()
        return plan

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

    # ---- schedule -------------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        plan = StepPlan()
        budget = self.config.max_num_batched_tokens
        self._prefills_left = self.config.max_num_partial_prefills or len(self.waiting) + len(
            self.running) + len(self.swapped) + 1
        preempted_before = self.num_preemptions
        priority = self.config.scheduling_policy == "priority"
        priority_preemptions = 0
        # rank order (preemption takes from the tail); a prompt's chunk leaves the budget the
        # decodes ranked after it need, so they all get their token this step
        running = list(self.running)
        decodes_after = self._decodes_after(running)
        for i, request in enumerate(running):
            if budget <= 0:
                break
            if priority and request.status is RequestStatus.RUNNING:
                budget, n = self._admit_outranking(request, plan, budget)
                priority_preemptions += n
            if request.status is RequestStatus.RUNNING:
                reserved = min(decodes_after[i], budget) if self._in_prompt(request) else 0
                budget = reserved + self._schedule_running(request, plan, budget - reserved)

        # After running requests had to give up blocks this step, nothing new starts: it would
        # only be preempted again. Swapped requests come back before waiting ones that rank
        # after them.
        memory_preempted = self.num_preemptions - preempted_before > priority_preemptions
        if not memory_preempted:
            budget = self._swap_in(plan, budget)
        if not memory_preempted and (
            not self.swapped
            or (self.waiting and self._key(self.waiting[0]) < self._key(self.swapped[0]))
        ):
            self._admit_waiting(plan, budget)
        plan.block_copies = self.kv.take_block_copies()
        plan.tier_saves, plan.tier_loads = self.kv.take_tier_io()
        plan.swap_out, self._swap_out = self._swap_out, []
        plan.finished_seq_ids, self._dropped = self._dropped, []
        self.peak_running_seqs = max(self.peak_running_seqs, self.num_running_seqs)
        return plan

    @staticmethod
    def _decodes_after(running: list[Request]) -> list[int]:
        """Per running request, the decoding sequences of the requests ranked after it."""
        after, total = [], 0
        for request in reversed(running):
            after.append(total)
            total += sum(seq.num_new_tokens == 1 for seq in request.live_seqs)
        return after[::-1]

    @staticmethod
    def _in_prompt(request: Request) -> bool:
        """Whether a running request still has more than its next token to compute (a prompt,
        or the recomputation after a preemption)."""
        return any(seq.num_new_tokens > 1 for seq in request.live_seqs)

    def _prefill_chunk(self, num_new_tokens: int, budget: int) -> int:
        """The tokens a prompt's chunk takes this step: its budget share, 0 when this step's
        prompts are all taken (max_num_partial_prefills)."""
        if num_new_tokens <= 1:
            return min(num_new_tokens, budget)
        if self._prefills_left <= 0:
            return 0
        limit = self.config.long_prefill_token_threshold
        return min(num_new_tokens, budget, limit) if limit else min(num_new_tokens, budget)

    def _schedule_running(self, request: Request, plan: StepPlan, budget: int) -> int:
        slots: list[Slot] = []
        drafts: dict[int, tuple[list[int], int]] = {}
        prompt = False
        for seq in request.live_seqs:
            left = budget - sum(s[2] for s in slots) - sum(d[1] for d in drafts.values())
            n = self._prefill_chunk(seq.num_new_tokens, left)
            if n <= 0:
                continue
            prompt = prompt or n > 1
            start = seq.num_computed_tokens
            new = None
            draft = self._propose(seq, left - 1) if n == seq.num_new_tokens == 1 else ([], 0)
            if draft[1]:
                new = self.kv.allocate_slots(seq, n, num_lookahead_tokens=draft[1])
                if new is not None:  # else no blocks for the drafts: decode without them
                    drafts[seq.seq_id] = draft
            if new is None:
                new = self.kv.allocate_slots(seq, n)
            while new is None and self.running[-1] is not request:
                self._preempt(self.running[-1])
                new = self.kv.allocate_slots(seq, n)
            if new is None:
                # Nothing ranks below it. Its sequences (n samples, beams) need not all advance
                # together: those that got blocks run, the others wait for blocks. Only when not
                # even one fits is it preempted; alone, by recompute, which re-admits one
                # sequence at a time, so it always makes progress.
                if not slots:
                    self._preempt(request, recompute=len(self.running) == 1)
                break
            slots.append((seq, start, n, new))
        for slot in slots:
            self._emit(request, *slot, plan, drafts.get(slot[0].seq_id))
        if prompt and slots:
            self._prefills_left -= 1
        return budget - sum(s[2] for s in slots) - sum(d[1] for d in drafts.values())

    def _propose(self, seq: Sequence, room: int) -> tuple[list[int], int]:
        """(draft tokens, number of drafts) for a decoding sequence (speculative decoding; a
        drafting model's tokens come from the runner). Beams never speculate, nor does a
        prompt about to fork into n samples; a constrained sequence keeps only drafts its
        grammar takes (and gets none from a drafting model: its masks are computed ahead)."""
        spec = self.speculator
        if spec is None or seq.request.beam is not None or needs_fan_out(seq.request):
            return [], 0
        if seq.grammar is not None and spec.config.drafts_in_runner:
            return [], 0
        if seq.draft is None:
            seq.draft = DraftState()
        mt = seq.request.params.max_tokens
        if mt is not None:  # the step yields up to drafts + 1 tokens; no draft past max_tokens
            room = min(room, mt - seq.num_output_tokens - 1)
        tokens, k = spec.propose(seq.draft, seq.token_ids, room)
        if seq.grammar is not None and tokens:
            tokens = tokens[: seq.grammar.validate_tokens(tokens)]
            k = len(tokens)
        return tokens, k

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
            self._preempt(tail)
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

    def _emit(self, request: Request, seq: Sequence, start: int, n: int, new: NewBlocks,
              plan: StepPlan, drafts: tuple[list[int], int] | None = None) -> None:
        """Put one sequence's chunk in the plan (and, the first time, the sequence itself)."""
        self._sync_runner(seq, new, plan)
        sample: tuple[int, ...] = ()
        if start + n == len(seq.token_ids):  # it catches up with its tokens: sample the next
            sample = (seq.seq_id,)
            if needs_fan_out(request):
                children = fan_out(request, self.kv)
                for child in children:
                    self.seqs[child.seq_id] = child
                    self._sync_runner(child, None, plan)
                sample += tuple(c.seq_id for c in children)
        wants_prompt_logprobs = (
            request.params.prompt_logprobs is not None
            and seq.index == 0
            and start + 1 < seq.num_prompt_tokens
        )
        tokens, num_drafts = drafts or ([], 0)
        plan.chunks.append(SeqChunk(seq.seq_id, seq.token_ids[start : start + n], start,
                                    sample, wants_prompt_logprobs, tokens, num_drafts))

    def _sync_runner(self, seq: Sequence, new: NewBlocks | None, plan: StepPlan) -> None:
        """Tell the runner about a sequence it does not hold yet (all of it), or about the block
        ids that changed for one it holds."""
        if not seq.in_runner:
            first, *others = self.kv.block_tables(seq.seq_id)
            plan.new_seqs.append(NewSeq(seq.seq_id, list(seq.token_ids), seq.num_prompt_tokens,
                                        seq.index, seq.request.params, first, others))
            seq.in_runner = True
        elif new is not None:
            if new.block_ids:
                plan.block_table_updates.append((seq.seq_id, new.start, new.block_ids))
            for group, (start, block_ids) in enumerate(new.other_groups, 1):
                if block_ids:
                    plan.group_table_updates.append((seq.seq_id, group, start, block_ids))

    def _preempt(self, victim: Request, recompute: bool = False) -> None:
        self.running.remove(victim)
        victim.num_preemptions += 1
        self.num_preemptions += 1
        seqs = victim.live_seqs
        for seq in seqs:
            self._drop_from_runner(seq)
        if self.config.preemption_mode == "swap" and not recompute:
            copies = self.kv.swap_out([s.seq_id for s in seqs])
            if copies is not None:
                self._swap_out.extend(copies)
                victim.status = RequestStatus.SWAPPED
                bisect.insort(self.swapped, victim, key=self._key)
                return
        for seq in seqs:
            self.kv.free(seq.seq_id)
        victim.status = RequestStatus.WAITING
        bisect.insort(self.waiting, victim, key=self._key)

    def _give_up(self, request: Request) -> None:
        """Finish a request that cannot fit the KV cache even alone; reported next update."""
        logger.warning("request %s cannot fit the KV cache (%d blocks) even alone; finishing it",
                       request.request_id, self.kv.num_blocks)
        for seq in request.seqs:
            if not seq.is_finished:
                seq.finish_reason = "length"
            self._release(seq)
        if request.beam is not None:
            request.beam.done = True
        request.status = RequestStatus.FINISHED
        self._ignored.append(request)

    def reserve_tokens(self, request: Request) -> int:
        """Prompt + max_tokens, capped at max_model_len: what a contiguous reservation holds."""
        return request.num_prompt_tokens + self._max_tokens(request)

    def _max_tokens(self, request: Request) -> int:
        limit = self.config.max_model_len - request.num_prompt_tokens
        mt = request.params.max_tokens
        return limit if mt is None else min(mt, limit)

    # ---- update ---------------------------------------------------------------------------
    def update_from_output(self, plan: StepPlan, out: RunnerOutput) -> list[RequestUpdate]:
        """Append what the runner sampled, finish what tokens alone finish (EOS, stop token ids,
        length: their blocks go back at once), take the beam steps; one update per request."""
        self.kv.tier_io_done(out.saved_blocks)
        now = time.monotonic()
        updates: dict[str, RequestUpdate] = {}

        def update(request: Request) -> RequestUpdate:
            u = updates.get(request.request_id)
            if u is None:
                u = updates[request.request_id] = RequestUpdate(request)
            return u

        for request in self._ignored:
            update(request)
        self._ignored.clear()
        beam_requests: dict[str, Request] = {}
        for chunk in plan.chunks:
            seq = self.seqs[chunk.seq_id]
            request = seq.request
            if request.first_scheduled_time is None:
                request.first_scheduled_time = now
            if chunk.context_len <= seq.num_prompt_tokens:
                self.num_prompt_tokens_total += len(chunk.token_ids)
            if chunk.prompt_logprobs:
                update(request).prompt_logprobs = (chunk.start_pos,
                                                   out.prompt_logprobs[chunk.seq_id])
            for seq_id in chunk.sample_seq_ids:
                sampled = self.seqs[seq_id]
                tokens = out.sampled_token_ids[seq_id]
                logprobs = out.logprobs.get(seq_id)
                if request.beam is not None:
                    assert logprobs is not None, "beams sample with logprobs"
                    request.beam.pending[seq_id] = logprobs[0]
                    beam_requests[request.request_id] = request
                else:
                    update(request).seqs.append(self._append(sampled, tokens, logprobs))
                    if sampled.draft is not None and self.speculator is not None:
                        self.speculator.record(sampled.draft, chunk.num_draft_tokens, tokens)
                if chunk.num_draft_tokens:  # the accepted drafts' slots are computed tokens
                    self.kv.accept_lookahead(seq_id, len(tokens) - 1)
        for request in beam_requests.values():
            if all(b.seq_id in request.beam.pending for b in request.live_seqs):
                self._beam_step(request)
                update(request).beam_step = True
        for chunk in plan.chunks:  # sliding windows: what no later query sees goes back now
            self.kv.free_out_of_window(chunk.seq_id)
            for seq_id in chunk.sample_seq_ids:
                if seq_id != chunk.seq_id:
                    self.kv.free_out_of_window(seq_id)
        return list(updates.values())

    def _append(self, seq: Sequence, tokens: list[int],
                logprobs: list | None) -> SeqUpdate:
        request = seq.request
        taken: list[int] = []
        for token in tokens:
            seq.append_token(token)
            taken.append(token)
            if seq.grammar is not None:
                if not seq.grammar.consume_token(token):
                    # the mask allowed only tokens the grammar takes: this happens only when
                    # nothing was allowed (allowed_token_ids outside the grammar) or the
                    # grammar hit a limit; never pass off such output as following it
                    error = seq.grammar.get_error().strip().splitlines()
                    seq.finish_reason = "abort"
                    seq.stop_reason = ("structured output error: "
                                       f"{error[0] if error else 'token not allowed'}")
                    break
                if token == request.eos_token_id and not request.params.ignore_eos:
                    # the grammar is complete and allowed only EOS: it wins over min_tokens
                    seq.finish_reason, seq.stop_reason = "stop", None
                    break
            stop = check_token_stop(request.params, seq.output_token_ids, request.eos_token_id,
                                    seq.num_prompt_tokens, self.config.max_model_len)
            if stop is not None:
                seq.finish_reason, seq.stop_reason = stop.finish_reason, stop.stop_reason
                break
        self.num_generation_tokens_total += len(taken)
        if seq.is_finished:
            self._finish_seq(seq)
        return SeqUpdate(seq, taken, logprobs[: len(taken)] if logprobs is not None else None)

    def _beam_step(self, request: Request) -> None:
        beams = len(request.live_seqs)
        born, died = beam_search.advance(request, self.kv)
        self.num_generation_tokens_total += beams
        for seq in died:
            self._release(seq)
        for seq in born:
            self.seqs[seq.seq_id] = seq
        if request.beam is not None and request.beam.done:
            for seq in request.seqs:
                self._release(seq)
            if request in self.running:
                self.running.remove(request)
            request.status = RequestStatus.FINISHED

    def request_ids_of(self, plan: StepPlan) -> list[str]:
        ids = {self.seqs[c.seq_id].request.request_id for c in plan.chunks if c.seq_id in self.seqs}
        return sorted(ids)

    def step_failed(self, plan: StepPlan) -> None:
        """The runner raised: blocks handed out for this step were registered in the prefix
        cache but never computed, so nobody may hit them (the caller aborts the requests)."""
        for chunk in plan.chunks:
            self.kv.uncache_from(chunk.seq_id, chunk.start_pos)
        self.kv.tier_io_failed()  # so were blocks it was to load from the KV tier
        self._dropped.extend(plan.finished_seq_ids)  # the runner may not have seen them

    # ---- freeing --------------------------------------------------------------------------
    def _finish_seq(self, seq: Sequence) -> None:
        self._release(seq)
        request = seq.request
        if request.is_finished and request in self.running:
            self.running.remove(request)
            request.status = RequestStatus.FINISHED

    def _release(self, seq: Sequence) -> None:
        """A sequence is done for good: its blocks go back, the runner forgets it."""
        self.kv.free(seq.seq_id)
        self._drop_from_runner(seq)
        self.seqs.pop(seq.seq_id, None)

    def _drop_from_runner(self, seq: Sequence) -> None:
        if seq.in_runner:
            self._dropped.append(seq.seq_id)
            seq.in_runner = False
