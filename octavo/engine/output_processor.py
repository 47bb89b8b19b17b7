"""From per-step updates to RequestOutputs: detokenizing, stop strings, logprobs, metrics.

It owns each request's text-side state (an incremental detokenizer per sequence, the text so
far, collected logprobs) and nothing else: a sequence's tokens and status belong to the
scheduler. A step's updates go through two calls: `process` detokenizes and checks stop
strings, returning a `TextStop` for each sequence a stop string ends (the scheduler applies
them: finish, drop tokens past the stop, free blocks); `make_outputs` then builds the step's
RequestOutputs. While a sequence runs, a tail that could still grow into a stop string is held
back from its text.

What an output carries follows its request's `output_kind` (sampling_params.py): the whole
text and tokens so far (CUMULATIVE), only what is new since its previous output (DELTA: a
stream's step costs what the step added, however long the stream), or one output at the end
(FINAL_ONLY). `tokens_copied` counts the token ids every output so far carried;
`progress` lists every request the last step touched, outputs or not (for metrics).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from octavo.engine.detokenizer import IncrementalDetokenizer
from octavo.engine.request import Request, RequestUpdate, Sequence
from octavo.engine.stop_checker import StopDecision, check_text_stop, partial_stop_len
from octavo.outputs import CompletionOutput, PositionLogprobs, RequestOutput, RequestProgress
from octavo.sampling_params import RequestOutputKind


@dataclass(slots=True)
class _SeqText:
    detokenizer: IncrementalDetokenizer | None
    text: str = ""
    logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float = 0.0
    # DELTA outputs: how much of the text, tokens and logprobs earlier outputs carried
    sent_text: int = 0
    sent_tokens: int = 0
    sent_logprobs: int = 0


@dataclass(frozen=True, slots=True)
class TextStop:
    """A stop string (or an EOS's hidden text) ended `seq`: the scheduler sets its finish and
    stop reasons, drops its last `drop_tokens` output tokens (sampled after the stop in one
    step of several tokens) and frees it if it still runs."""

    seq: Sequence
    decision: StopDecision
    drop_tokens: int = 0


@dataclass(slots=True)
class _RequestState:
    seqs: dict[int, _SeqText] = field(default_factory=dict)  # by seq_id
    prompt_logprobs: list[PositionLogprobs | None] | None = None


class OutputProcessor:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._states: dict[str, _RequestState] = {}
        self.tokens_copied = 0  # token ids carried by every output so far
        self.progress: list[RequestProgress] = []  # the last step's requests

    def add_request(self, request: Request) -> None:
        state = _RequestState()
        if request.params.prompt_logprobs is not None:
            state.prompt_logprobs = [None]  # nothing predicts the first prompt token
        self._states[request.request_id] = state

    def abort_request(self, request_id: str) -> None:
        self._states.pop(request_id, None)

    def process(self, updates: list[RequestUpdate]) -> list[TextStop]:
        """Detokenize the step's new tokens and check stop strings; the stops found, for the
        scheduler to apply before `make_outputs`."""
        stops: list[TextStop] = []
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
                stop = self._add_tokens(state, su.seq, su.new_token_ids, su.new_logprobs)
                if stop is not None:
                    stops.append(stop)
        return stops

    def make_outputs(self, updates: list[RequestUpdate]) -> list[RequestOutput]:
        """The RequestOutputs of the requests this step touched (after the scheduler applied
        the stops `process` found)."""
        now = time.monotonic()
        outputs: list[RequestOutput] = []
        self.progress = []
        for update in updates:
            request = update.request
            state = self._states.get(request.request_id)
            if state is None:
                continue
            if update.seqs or update.beam_step:
                request.first_token_time = request.first_token_time or now
                request.last_token_time = now
            elif not request.is_finished:
                continue  # only prompt logprobs so far: nothing to show yet
            out = self._make_output(request, state)
            if out is not None:
                outputs.append(out)
            if out is not None and out.outputs:
                reason = out.outputs[0].finish_reason
            else:
                reason = request.seqs[0].finish_reason if request.seqs else None
            self.progress.append(RequestProgress(
                request.request_id, _timestamps(request), request.is_finished, reason,
                len(request.prompt_token_ids),
                sum(seq.num_output_tokens for seq in request.seqs)))
        return outputs

    def _add_tokens(self, state: _RequestState, seq: Sequence, tokens: list[int],
                    logprobs: list[PositionLogprobs] | None) -> TextStop | None:
        """Detokenize a sequence's new tokens and check its stop strings; the stop when one
        ends the sequence (or hides the text of the token that ended it)."""
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
                    return self._stop(text, seq, decision, len(tokens) - 1 - i)
            return None
        decision = self._add_text(text, params, tokens, lps, seq.num_output_tokens, seq)
        return None if decision is None else self._stop(text, seq, decision, 0)

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
    def _stop(text: _SeqText, seq: Sequence, decision: StopDecision,
              drop_tokens: int) -> TextStop:
        if decision.output_text is not None:
            text.text = decision.output_text
        elif text.detokenizer is not None:
            text.text += text.detokenizer.finish()
        return TextStop(seq, decision, drop_tokens)

    def _make_output(self, request: Request, state: _RequestState) -> RequestOutput | None:
        finished = request.is_finished
        if finished:
            request.finished_time = time.monotonic()
        kind = request.params.output_kind
        if kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        if request.beam is not None:
            outputs = self._beam_outputs(request) if finished else []
        else:
            outputs = [self._seq_output(seq, state, kind == RequestOutputKind.DELTA)
                       for seq in request.seqs]
        self.tokens_copied += sum(len(o.token_ids) for o in outputs)
        if finished:
            self._states.pop(request.request_id, None)
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            prompt_logprobs=state.prompt_logprobs,
            outputs=outputs,
            finished=finished,
            num_cached_tokens=request.num_cached_tokens or 0,
            metrics=_timestamps(request),
        )

    def _seq_output(self, seq: Sequence, state: _RequestState, delta: bool) -> CompletionOutput:
        """One sequence's output: everything so far, or (delta) what is new since the last."""
        text = state.seqs.get(seq.seq_id) or _SeqText(None)  # None: no token yet
        stop = seq.request.params.stop
        shown = len(text.text)
        if not seq.is_finished and stop:
            shown -= partial_stop_len(text.text, stop)
        start_text = text.sent_text if delta else 0
        start_tokens = seq.num_prompt_tokens + (text.sent_tokens if delta else 0)
        start_lps = text.sent_logprobs if delta else 0
        out = CompletionOutput(
            index=seq.index,
            text=text.text[start_text:shown] if shown > start_text else "",
            token_ids=seq.token_ids[start_tokens:],
            cumulative_logprob=text.cumulative_logprob
            if seq.request.params.logprobs is not None else None,
            logprobs=text.logprobs[start_lps:] if text.logprobs is not None else None,
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
        )
        if delta:
            text.sent_text = max(text.sent_text, shown)
            text.sent_tokens = seq.num_output_tokens
            text.sent_logprobs = len(text.logprobs) if text.logprobs is not None else 0
        return out

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


def _timestamps(request: Request) -> dict[str, float | None]:
    return {
        "arrival_time": request.arrival_time,
        "first_scheduled_time": request.first_scheduled_time,
        "first_token_time": request.first_token_time,
        "last_token_time": request.last_token_time,
        "finished_time": request.finished_time,
    }
