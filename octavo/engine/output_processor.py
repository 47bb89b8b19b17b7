"""From per-step updates to RequestOutputs: detokenizing, stop strings, logprobs, metrics.

It owns each request's text-side state (an incremental detokenizer per sequence, the text so
far, collected logprobs). A stop string found here finishes its sequence: `process` returns
those sequences so the engine has the scheduler free them before the next step. While a
sequence runs, a tail that could still grow into a stop string is held back from its text.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from octavo.engine.detokenizer import IncrementalDetokenizer
from octavo.engine.request import Request, RequestUpdate, Sequence
from octavo.engine.stop_checker import StopDecision, check_text_stop, partial_stop_len
from octavo.outputs import CompletionOutput, PositionLogprobs, RequestOutput


@dataclass(slots=True)
class _SeqText:
    detokenizer: IncrementalDetokenizer | None
    text: str = ""
    logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float = 0.0


@dataclass(slots=True)
class _RequestState:
    seqs: dict[int, _SeqText] = field(default_factory=dict)  # by seq_id
    prompt_logprobs: list[PositionLogprobs | None] | None = None


class OutputProcessor:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._states: dict[str, _RequestState] = {}

    def add_request(self, request: Request) -> None:
        state = _RequestState()
        if request.params.prompt_logprobs is not None:
            state.prompt_logprobs = [None]  # nothing predicts the first prompt token
        self._states[request.request_id] = state

    def abort_request(self, request_id: str) -> None:
        self._states.pop(request_id, None)

    def process(self, updates: list[RequestUpdate]) -> tuple[list[RequestOutput], list[Sequence]]:
        """RequestOutputs of the requests this step touched, and the sequences stop strings
        finished (for the scheduler to free)."""
        now = time.monotonic()
        outputs: list[RequestOutput] = []
        stopped: list[Sequence] = []
        for update in updates:
            request = update.request
            state = self._states.get(request.request_id)
            if state is None:
                continue  # aborted since
            if update.prompt_logprobs is not None and state.prompt_logprobs is not None:
                start, entries = update.prompt_logprobs
                # entry t scores prompt token start + t + 1; a recomputed chunk repeats some
                have = len(state.prompt_logprobs)
                state.prompt_logprobs.extend(entries[max(0, have - start - 1):])
            for su in update.seqs:
                if self._add_tokens(state, su.seq, su.new_token_ids, su.new_logprobs):
                    stopped.append(su.seq)
            if update.seqs or update.beam_step:
                request.first_token_time = request.first_token_time or now
                request.last_token_time = now
            elif not request.is_finished:
                continue  # only prompt logprobs so far: nothing to show yet
            outputs.append(self._make_output(request, state))
        return outputs, stopped

    def _add_tokens(self, state: _RequestState, seq: Sequence, tokens: list[int],
                    logprobs: list[PositionLogprobs] | None) -> bool:
        """Detokenize a sequence's new tokens and check its stop strings; True when one ended a
        sequence the scheduler still runs."""
        params = seq.request.params
        text = state.seqs.get(seq.seq_id)
        if text is None:
            detok = None
            if params.detokenize:
                detok = IncrementalDetokenizer(
                    self.tokenizer, seq.request.prompt_token_ids,
                    skip_special_tokens=params.skip_special_tokens,
                    spaces_between_special_tokens=params.spaces_between_special_tokens,
                )
            text = state.seqs[seq.seq_id] = _SeqText(
                detok, logprobs=[] if params.logprobs is not None else None)
        lps = logprobs or [None] * len(tokens)
        if len(tokens) > 1 and params.detokenize:
            # several tokens in one step (speculative decoding), checked one by one as plain
            # decoding would: a stop string may end the text at any of them (the tokens after
            # it were never output), and an EOS or stop token hides only its own text
            for i in range(len(tokens)):
                last = i == len(tokens) - 1
                num_out = seq.num_output_tokens - (len(tokens) - 1 - i)
                decision = self._add_text(text, params, tokens[i : i + 1], lps[i : i + 1],
                                          num_out, seq if last else None)
                if decision is not None:
                    if not last:
                        seq.drop_last_tokens(len(tokens) - 1 - i)
                    return self._finish(text, seq, decision)
            return False
        decision = self._add_text(text, params, tokens, lps, seq.num_output_tokens, seq)
        return decision is not None and self._finish(text, seq, decision)

    @staticmethod
    def _add_text(text: _SeqText, params: Any, tokens: list[int],
                  logprobs: list[PositionLogprobs | None], num_output_tokens: int,
                  seq: Sequence | None) -> StopDecision | None:
        """Add tokens to the text; the stop decision they make (`seq`: the sequence whose
        token-side finish applies, None for tokens before its last)."""
        for token, lp in zip(tokens, logprobs, strict=True):
            if lp is not None:
                text.cumulative_logprob += lp[token].logprob
                if text.logprobs is not None:
                    text.logprobs.append(lp)
        delta = ""
        if text.detokenizer is not None:
            delta = text.detokenizer.append(tokens)
            text.text += delta
        token_decision = None
        if seq is not None and seq.finish_reason is not None:
            token_decision = StopDecision(seq.finish_reason, seq.stop_reason)
        return check_text_stop(params, token_decision, num_output_tokens, text.text, len(delta))

    @staticmethod
    def _finish(text: _SeqText, seq: Sequence, decision: StopDecision) -> bool:
        if decision.output_text is not None:
            text.text = decision.output_text
        elif text.detokenizer is not None:
            text.text += text.detokenizer.finish()
        still_running = seq.finish_reason is None
        seq.finish_reason, seq.stop_reason = decision.finish_reason, decision.stop_reason
        return still_running

    def _make_output(self, request: Request, state: _RequestState) -> RequestOutput:
        finished = request.is_finished
        if request.beam is not None:
            outputs = self._beam_outputs(request) if finished else []
        else:
            outputs = []
            stop = request.params.stop
            for seq in request.seqs:
                text = state.seqs.get(seq.seq_id)
                if text is None:
                    text = _SeqText(None)
                shown = text.text
                if not seq.is_finished and stop:
                    shown = shown[: len(shown) - partial_stop_len(shown, stop)]
                outputs.append(CompletionOutput(
                    index=seq.index,
                    text=shown,
                    token_ids=list(seq.output_token_ids),
                    cumulative_logprob=text.cumulative_logprob
                    if request.params.logprobs is not None else None,
                    logprobs=list(text.logprobs) if text.logprobs is not None else None,
                    finish_reason=seq.finish_reason,
                    stop_reason=seq.stop_reason,
                ))
        if finished:
            request.finished_time = time.monotonic()
            self._states.pop(request.request_id, None)
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            prompt_logprobs=state.prompt_logprobs,
            outputs=outputs,
            finished=finished,
            num_cached_tokens=request.num_cached_tokens or 0,
            metrics={
                "arrival_time": request.arrival_time,
                "first_scheduled_time": request.first_scheduled_time,
                "first_token_time": request.first_token_time,
                "last_token_time": request.last_token_time,
                "finished_time": request.finished_time,
            },
        )

    def _beam_outputs(self, request: Request) -> list[CompletionOutput]:
        beam = request.beam
        assert beam is not None
        outputs = []
        for index, hyp in enumerate(beam.finished):
            ended_by_eos = bool(hyp.token_ids) and hyp.token_ids[-1] == beam.eos_token_id
            outputs.append(CompletionOutput(
                index=index,
                text=self.tokenizer.decode(hyp.token_ids, skip_special_tokens=True),
                token_ids=list(hyp.token_ids),
                cumulative_logprob=hyp.cum_logprob,
                logprobs=None,
                finish_reason="stop" if ended_by_eos and not beam.params.ignore_eos
                else "length",
            ))
        return outputs
