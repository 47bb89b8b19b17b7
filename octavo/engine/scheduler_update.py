"""The scheduler's update after a step: what the runner sampled is appended to the sequences,
sequences finish (on tokens alone: EOS, stop token ids, length; then on the output processor's
stop strings) and give their blocks back at once, beams take their step, and a step that failed
leaves nothing in the prefix cache that it did not compute.

SchedulerUpdate is a part of Scheduler (scheduler.py), which inherits it: it moves the
scheduler's sequences on, the only writer of their state, and frees what finished with the
scheduler's `_release`.
"""

from __future__ import annotations

import time

from octavo.config import SchedulerConfig
from octavo.engine import beam_search
from octavo.engine.output_processor import TextStop
from octavo.engine.request import Request, RequestStatus, RequestUpdate, Sequence, SeqUpdate
from octavo.engine.speculator import Speculator
from octavo.engine.stop_checker import check_token_stop
from octavo.paging.allocator import KVAllocator
from octavo.step_plan import RunnerOutput, StepPlan


class SchedulerUpdate:
    """What a step's output does to the sequences (a part of Scheduler)."""

    # the scheduler's state (Scheduler.__init__)
    config: SchedulerConfig
    kv: KVAllocator
    running: list[Request]
    seqs: dict[int, Sequence]
    speculator: Speculator | None
    num_prompt_tokens_total: int
    num_generation_tokens_total: int
    _dropped: list[int]
    _ignored: list[Request]

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

        for chunk in plan.chunks:  # what the step computed may now be found (state snapshots)
            self.kv.commit_step(chunk.seq_id)
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

    # ---- finishing ------------------------------------------------------------------------
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

    def _finish_seq(self, seq: Sequence) -> None:
        self._release(seq)
        request = seq.request
        if request.is_finished and request in self.running:
            self.running.remove(request)
            request.status = RequestStatus.FINISHED
