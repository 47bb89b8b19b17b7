"""Iteration-level (continuous-batching) scheduler with chunked prefill and preemption.

Two calls a step, around the runner: `schedule()` builds the StepPlan, `update_from_output()`
takes what the runner sampled and moves the sequences on. The class is in three modules: this
one builds the plan (running requests, preemption, the runner's view of each sequence),
scheduler_admission.py brings swapped-out and waiting requests in, scheduler_update.py takes
a step's output; Scheduler inherits the other two.

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

from octavo.config import SchedulerConfig
from octavo.engine.parallel_sampling import fan_out, needs_fan_out
from octavo.engine.request import Request, RequestStatus, Sequence
from octavo.engine.scheduler_admission import SchedulerAdmission, Slot
from octavo.engine.scheduler_update import SchedulerUpdate
from octavo.engine.speculator import DraftState, Speculator
from octavo.paging.allocator import KVAllocator, NewBlocks
from octavo.step_plan import NewSeq, SeqChunk, StepPlan

logger = logging.getLogger(__name__)


class Scheduler(SchedulerAdmission, SchedulerUpdate):
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
        plan.state_transfers, plan.state_snapshots = self.kv.take_state_ops()
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
                self._preempt(self.running[-1], plan=plan)
                new = self.kv.allocate_slots(seq, n)
            if new is None:
                # Nothing ranks below it. Its sequences (n samples, beams) need not all advance
                # together: those that got blocks run, the others wait for blocks. Only when not
                # even one fits is it preempted; alone, by recompute, which re-admits one
                # sequence at a time, so it always makes progress.
                if not slots:
                    self._preempt(request, recompute=len(self.running) == 1, plan=plan)
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

    def _preempt(self, victim: Request, recompute: bool = False,
                 plan: StepPlan | None = None) -> None:
        """Take `victim`'s blocks back: swap them out, or free them to be recomputed. A victim
        already in this step's `plan` (a decode scheduled before a higher-ranked prompt ran out
        of blocks) is taken out of it again, and is recomputed: its slots were counted as
        computed for a chunk that now does not run."""
        if plan is not None and self._take_back(victim, plan):
            recompute = True
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

    def _take_back(self, request: Request, plan: StepPlan) -> bool:
        """Remove a request's sequences from `plan`; whether it had chunks there."""
        ids = {seq.seq_id for seq in request.seqs}
        chunks = [c for c in plan.chunks if c.seq_id in ids]
        for chunk in chunks:  # registered in the prefix cache, never computed
            self.kv.uncache_from(chunk.seq_id, chunk.start_pos)
        plan.chunks = [c for c in plan.chunks if c.seq_id not in ids]
        plan.new_seqs = [s for s in plan.new_seqs if s.seq_id not in ids]
        plan.block_table_updates = [u for u in plan.block_table_updates if u[0] not in ids]
        plan.group_table_updates = [u for u in plan.group_table_updates if u[0] not in ids]
        return bool(chunks)

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

    # ---- freeing --------------------------------------------------------------------------
    def _release(self, seq: Sequence) -> None:
        """A sequence is done for good: its blocks go back, the runner forgets it."""
        self.kv.free(seq.seq_id)
        self._drop_from_runner(seq)
        self.seqs.pop(seq.seq_id, None)

    def _drop_from_runner(self, seq: Sequence) -> None:
        if seq.in_runner:
            self._dropped.append(seq.seq_id)
            seq.in_runner = False
