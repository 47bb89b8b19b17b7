"""The engine: step() = schedule -> execute -> sample -> update.

It owns the tokenizer, the KV manager, the scheduler and the model runner. Servers drive it with
add_request / step / abort_request; the offline `LLM` loops step() until everything finished.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time

import torch
from transformers import AutoTokenizer

from octavo.config import EngineConfig, ModelConfig
from octavo.engine.beam_search import BeamSearchState
from octavo.engine.detokenizer import IncrementalDetokenizer
from octavo.engine.kv_sizing import make_kv_manager, size_kv_cache
from octavo.engine.outputs import CompletionOutput, RequestOutput
from octavo.engine.request import Request, RequestStatus, Sequence
from octavo.engine.sampling_params import BeamSearchParams, SamplingParams
from octavo.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from octavo.engine.stop_checker import check_stop, partial_stop_len
from octavo.model.loader import resolve_model_dir
from octavo.model.runner import ModelRunner, resolve_device, resolve_dtype
from octavo.model.sampler import Sampler, SamplingBatch, compute_logprobs, make_generator
from octavo.step_plan import SeqChunk, StepPlan

logger = logging.getLogger(__name__)

class LLMEngine:
    def __init__(self, config: EngineConfig, contiguous_reserve: str = "max_model_len") -> None:
        self.config = config
        self.model_dir = resolve_model_dir(config.model)
        self.model_config = ModelConfig.from_dir(self.model_dir)
        self.dtype = resolve_dtype(config.dtype)
        self.device = resolve_device(config.device)
        torch.manual_seed(config.seed)
        self.tokenizer = AutoTokenizer.from_pretrained(str(self.model_dir))
        self.eos_token_id = self.tokenizer.eos_token_id
        if self.eos_token_id is None and self.model_config.eos_token_ids:
            self.eos_token_id = self.model_config.eos_token_ids[0]
        sizing = size_kv_cache(config, self.model_config, self.dtype, self.device)
        self.max_model_len = sizing.max_model_len
        self.kv = make_kv_manager(config.cache, sizing, contiguous_reserve)
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_model_len=sizing.max_model_len,
                preemption_mode=config.preemption_mode,
                scheduling_policy=config.scheduling_policy,
            ),
            self.kv,
        )
        self.runner = ModelRunner(
            self.model_dir, self.model_config, dtype=self.dtype, device=self.device,
            num_blocks=sizing.num_blocks, block_size=config.cache.block_size,
            max_model_len=sizing.max_model_len, num_host_blocks=sizing.num_host_blocks,
            backend=config.attention_backend,
            linear_backend=config.linear_backend,
            fused_ops=config.fused_ops,
        )
        self.sampler = Sampler()
        self.requests: dict[str, Request] = {}
        self._arrivals = itertools.count()
        self.num_prompt_tokens_total = 0
        self.num_generation_tokens_total = 0

    # ---- requests -------------------------------------------------------------------------
    def tokenize(self, prompt: str | dict) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" not in prompt:
                raise ValueError("a dict prompt needs 'prompt_token_ids' (vLLM's TokensPrompt)")
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        if not isinstance(prompt, str):
            raise TypeError(f"prompt must be a str or a dict, got {type(prompt).__name__}")
        return prompt, self.tokenizer.encode(prompt)

    def add_request(
        self,
        request_id: str,
        prompt: str | dict,
        params: SamplingParams | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
        beam_params: BeamSearchParams | None = None,
    ) -> Request:
        if beam_params is not None:
            # beams are chosen by BeamSearchState, not sampled; EOS is handled there too
            params = SamplingParams(
                temperature=0, max_tokens=beam_params.max_tokens, ignore_eos=True,
                detokenize=False,
            )
        params = params or SamplingParams()
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, token_ids = self.tokenize(prompt)
        self._validate_prompt(token_ids, params)
        request = Request(
            request_id=request_id,
            prompt=text,
            prompt_token_ids=token_ids,
            params=params,
            arrival_index=next(self._arrivals),
            priority=priority,
            cache_salt=prompt.get("cache_salt") if isinstance(prompt, dict) else None,
        )
        if arrival_time is not None:
            request.arrival_time = arrival_time
        if beam_params is not None:
            limit = self.max_model_len - len(token_ids)
            beam_params = dataclasses.replace(
                beam_params, max_tokens=min(beam_params.max_tokens, limit)
            )
            request.beam = BeamSearchState(beam_params, self.eos_token_id)
        self._init_seq(request.seqs[0])
        self.requests[request_id] = request
        self.scheduler.add_request(request)
        return request

    def _validate_prompt(self, token_ids: list[int], params: SamplingParams) -> None:
        if not token_ids:
            raise ValueError("the prompt is empty: at least one token is needed")
        n = len(token_ids)
        if n >= self.max_model_len:
            raise ValueError(
                f"the prompt has {n} tokens but max_model_len is {self.max_model_len}: "
                "it must be shorter, leaving room for at least one generated token"
            )
        vocab = self.model_config.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is out of range [0, {vocab})")

    def _init_seq(self, seq: Sequence) -> None:
        p = seq.request.params
        if p.detokenize:
            seq.detokenizer = IncrementalDetokenizer(
                self.tokenizer, seq.request.prompt_token_ids,
                skip_special_tokens=p.skip_special_tokens,
                spaces_between_special_tokens=p.spaces_between_special_tokens,
            )
        if p.logprobs is not None:
            seq.logprobs = []

    def abort_request(self, request_id: str) -> bool:
        """Abort a request in any state; all its blocks go back to the pool at once."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return False
        self.scheduler.remove_request(request)
        for seq in request.seqs:
            if not seq.is_finished:
                seq.finish_reason = "abort"
        request.status = RequestStatus.FINISHED
        return True

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- one step -------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        sched = self.scheduler.schedule()
        now = time.monotonic()
        plan = StepPlan(
            chunks=[
                SeqChunk(
                    token_ids=s.seq.token_ids[s.start_pos : s.start_pos + s.num_new_tokens],
                    start_pos=s.start_pos,
                    block_table=self.kv.block_table(s.seq.seq_id),
                    sample=s.sample,
                    all_logits=s.prompt_logits,
                )
                for s in sched.scheduled
            ],
            block_copies=sched.block_copies,
            swap_out=sched.swap_out,
            swap_in=sched.swap_in,
        )
        try:
            result = self.runner.execute(plan)
        except BaseException:
            # The blocks handed out for this step were registered in the prefix cache but
            # never computed: nobody may hit them. The caller aborts the requests.
            for s in sched.scheduled:
                self.kv.uncache_from(s.seq.seq_id, s.start_pos)
            raise
        touched: dict[str, Request] = {}
        for request in self.scheduler.ignored:
            logger.warning(
                "request %s cannot fit the KV cache (%d blocks) even alone; finishing it",
                request.request_id, self.kv.num_blocks,
            )
            for seq in request.seqs:
                if not seq.is_finished:
                    seq.finish_reason = "length"
            if request.beam is not None:
                request.beam.done = True
            touched[request.request_id] = request
        self.scheduler.ignored.clear()
        for s in sched.scheduled:
            s.seq.num_computed_tokens += s.num_new_tokens
            request = s.seq.request
            if request.first_scheduled_time is None:
                request.first_scheduled_time = now
            if s.seq.num_computed_tokens <= s.seq.num_prompt_tokens:
                self.num_prompt_tokens_total += s.num_new_tokens
        for s, logits in zip(
            (s for s in sched.scheduled if s.prompt_logits), result.all_logits, strict=True
        ):
            self._prompt_logprobs(s, logits)
        self._sample(sched, result.logits, touched)
        return [self._make_output(r) for r in touched.values()]

    def _prompt_logprobs(self, s, logits: torch.Tensor) -> None:
        request = s.seq.request
        if request.prompt_logprobs is None:
            request.prompt_logprobs = [None]
        prompt = request.prompt_token_ids
        end = min(s.start_pos + s.num_new_tokens, len(prompt) - 1)
        targets = prompt[s.start_pos + 1 : end + 1]
        if targets:
            k = request.params.prompt_logprobs
            request.prompt_logprobs.extend(compute_logprobs(logits[: len(targets)], targets, k))

    def _sample(self, sched: SchedulerOutput, logits: torch.Tensor, touched) -> None:
        rows: list[int] = []
        seqs: list[Sequence] = []
        beam_requests: dict[str, Request] = {}
        for row, s in enumerate(x for x in sched.scheduled if x.sample):
            request = s.seq.request
            if request.beam is not None:
                s.seq.pending_logprobs = torch.log_softmax(logits[row].float(), dim=-1)
                beam_requests[request.request_id] = request
            elif len(request.seqs) < request.params.n:
                self._fork_children(request)  # parallel sampling: share the prompt's blocks
                for seq in request.seqs:
                    rows.append(row)
                    seqs.append(seq)
            else:
                rows.append(row)
                seqs.append(s.seq)
        for request in beam_requests.values():
            if all(seq.pending_logprobs is not None for seq in request.seqs):
                self._beam_step(request)
                touched[request.request_id] = request
        if not seqs:
            return
        params = [s.request.params for s in seqs]
        batch = SamplingBatch.from_params(
            params,
            [s.request.prompt_token_ids for s in seqs],
            [s.output_token_ids for s in seqs],
            [self._generator(s) for s in seqs],
            self.model_config.vocab_size,
            device=logits.device,
            eos_token_id=self.eos_token_id,
        )
        row_index = torch.tensor(rows, dtype=torch.long, device=logits.device)
        out = self.sampler(logits[row_index], batch)
        now = time.monotonic()
        for seq, token, lp in zip(seqs, out.sampled_token_ids, out.logprobs, strict=True):
            self._append_token(seq, token, lp)
            request = seq.request
            request.first_token_time = request.first_token_time or now
            request.last_token_time = now
            touched[request.request_id] = request
        self.num_generation_tokens_total += len(seqs)

    def _beam_step(self, request: Request) -> None:
        """Choose the next beams; a beam continued twice forks, one not continued is freed."""
        beams = request.seqs
        logprobs = torch.stack([b.pending_logprobs for b in beams])
        selections = request.beam.step(logprobs, [b.output_token_ids for b in beams])
        now = time.monotonic()
        request.first_token_time = request.first_token_time or now
        request.last_token_time = now
        self.num_generation_tokens_total += len(beams)
        for b in beams:
            b.pending_logprobs = None
        if request.beam.done:
            self.scheduler.finish_request(request)
            return
        continued: set[int] = set()
        next_beams: list[tuple[Sequence, int, float]] = []
        for sel in selections:  # fork from the parents' current state before any token lands
            parent = beams[sel.parent]
            if sel.parent in continued:
                seq = Sequence(
                    request, list(parent.token_ids), parent.num_prompt_tokens,
                    num_computed_tokens=parent.num_computed_tokens,
                )
                self.kv.fork(parent.seq_id, seq.seq_id)
            else:
                continued.add(sel.parent)
                seq = parent
            next_beams.append((seq, sel.token_id, sel.cum_logprob))
        for index, parent in enumerate(beams):
            if index not in continued:
                self.kv.free(parent.seq_id)  # a beam that dies frees its own blocks
        for index, (seq, token, cum) in enumerate(next_beams):
            seq.token_ids.append(token)
            seq.cumulative_logprob = cum
            seq.index = index
        request.seqs = [seq for seq, _, _ in next_beams]

    def _fork_children(self, request: Request) -> None:
        parent = request.seqs[0]
        for index in range(1, request.params.n):
            child = Sequence(
                request, list(parent.token_ids), parent.num_prompt_tokens, index=index,
                num_computed_tokens=parent.num_computed_tokens,
            )
            self.kv.fork(parent.seq_id, child.seq_id)
            self._init_seq(child)
            request.seqs.append(child)

    @staticmethod
    def _generator(seq: Sequence) -> torch.Generator | None:
        seed = seq.request.params.seed
        if seed is None:
            return None
        # A stream per (seed, output index, position): reproducible whatever else is batched
        # with it, after preemption too, and distinct for each of the n parallel samples.
        return make_generator(hash((seed, seq.index, seq.num_output_tokens)) & (2**63 - 1))

    def _append_token(self, seq: Sequence, token: int, logprobs) -> None:
        seq.token_ids.append(token)
        params = seq.request.params
        if logprobs is not None:
            seq.cumulative_logprob += logprobs[token].logprob
            if seq.logprobs is not None:
                seq.logprobs.append(logprobs)
        delta = ""
        if seq.detokenizer is not None:
            delta = seq.detokenizer.append([token])
            seq.output_text += delta
        decision = check_stop(
            params, seq.output_token_ids, seq.output_text, len(delta), self.eos_token_id,
            seq.num_prompt_tokens, self.max_model_len,
        )
        if decision is None:
            return
        if seq.detokenizer is not None and decision.output_text is None:
            seq.output_text += seq.detokenizer.finish()
        if decision.output_text is not None:
            seq.output_text = decision.output_text
        seq.finish_reason = decision.finish_reason
        seq.stop_reason = decision.stop_reason
        self.scheduler.finish_seq(seq)

    def _beam_outputs(self, request: Request) -> list[CompletionOutput]:
        outputs = []
        for index, hyp in enumerate(request.beam.finished):
            ended_by_eos = bool(hyp.token_ids) and hyp.token_ids[-1] == self.eos_token_id
            outputs.append(CompletionOutput(
                index=index,
                text=self.tokenizer.decode(hyp.token_ids, skip_special_tokens=True),
                token_ids=list(hyp.token_ids),
                cumulative_logprob=hyp.cum_logprob,
                logprobs=None,
                finish_reason="stop" if ended_by_eos and not request.beam.params.ignore_eos
                else "length",
            ))
        return outputs

    def _make_output(self, request: Request) -> RequestOutput:
        finished = request.is_finished
        if request.beam is not None:
            return self._finish_output(request, self._beam_outputs(request) if finished else [])
        outputs = []
        for seq in request.seqs:
            text = seq.output_text
            if not seq.is_finished and request.params.stop:
                text = text[: len(text) - partial_stop_len(text, request.params.stop)]
            outputs.append(CompletionOutput(
                index=seq.index,
                text=text,
                token_ids=list(seq.output_token_ids),
                cumulative_logprob=seq.cumulative_logprob
                if request.params.logprobs is not None else None,
                logprobs=list(seq.logprobs) if seq.logprobs is not None else None,
                finish_reason=seq.finish_reason,
                stop_reason=seq.stop_reason,
            ))
        return self._finish_output(request, outputs)

    def _finish_output(self, request: Request, outputs: list[CompletionOutput]) -> RequestOutput:
        finished = request.is_finished
        if finished:
            request.finished_time = time.monotonic()
            self.requests.pop(request.request_id, None)
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            prompt_logprobs=request.prompt_logprobs,
            outputs=outputs,
            finished=finished,
            metrics={
                "arrival_time": request.arrival_time,
                "first_scheduled_time": request.first_scheduled_time,
                "first_token_time": request.first_token_time,
                "last_token_time": request.last_token_time,
                "finished_time": request.finished_time,
            },
        )

    # ---- introspection --------------------------------------------------------------------
    def stats(self) -> dict[str, int | float]:
        s = dict(self.kv.stats())
        sch = self.scheduler
        s.update(
            num_requests_running=len(sch.running),
            num_requests_waiting=len(sch.waiting),
            num_requests_swapped=len(sch.swapped),
            num_preemptions=sch.num_preemptions,
            peak_running_seqs=sch.peak_running_seqs,
            prompt_tokens_total=self.num_prompt_tokens_total,
            generation_tokens_total=self.num_generation_tokens_total,
        )
        return s

    def check_invariants(self) -> None:
        self.kv.check_invariants()


