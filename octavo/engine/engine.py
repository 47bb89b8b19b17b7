"""The engine: wiring. A step is three calls, on the lines of vLLM v1 and nano-vllm:

    plan = scheduler.schedule()                      # which sequences compute which tokens
    out = runner.execute(plan)                       # forward pass and sampling
    updates = scheduler.update_from_output(plan, out)

then the output processor turns the updates into RequestOutputs (detokenizing, stop strings).
Structured outputs add one call between the first two: the grammar bitmask of the step
starts computing on a worker thread and the runner collects it when it samples.
Servers drive it with add_request / step / abort_request; the offline `LLM` loops step() until
everything finished. See docs/ARCHITECTURE.md for who owns which state.
"""

from __future__ import annotations

import gc
import logging
import time
import weakref

from octavo.config import ModelConfig
from octavo.engine.executor import Executor, make_executor
from octavo.engine.input_processor import InputProcessor, Prepared, load_tokenizer
from octavo.engine.kv_map import KVMapper
from octavo.engine.kv_sizing import check_max_model_len, make_kv_manager, resolve_max_model_len
from octavo.engine.kv_tier_setup import fingerprint, open_tier
from octavo.engine.output_processor import OutputProcessor
from octavo.engine.request import Request
from octavo.engine.scheduler import Scheduler
from octavo.engine.structured_output import StructuredOutputs
from octavo.engine_args import EngineArgs
from octavo.gc_heap import freeze_gc_heap
from octavo.malloc_heap import keep_freed_memory
from octavo.model.sources import resolve_model_dir
from octavo.outputs import RequestOutput, RequestProgress
from octavo.paging.block_hash import BlockHasher
from octavo.sampling_params import BeamSearchParams, SamplingParams

logger = logging.getLogger(__name__)


class StepFailed(RuntimeError):
    """The runner raised during a step; `request_ids` were in it (the cause is chained). The
    caller aborts them; requests outside the step are untouched."""

    def __init__(self, request_ids: list[str], cause: BaseException) -> None:
        super().__init__(f"engine step failed: {cause}")
        self.request_ids = request_ids


class LLMEngine:
    def __init__(self, args: EngineArgs) -> None:
        self.args = args
        self.model_dir = resolve_model_dir(args.model)
        self.model_config = ModelConfig.from_dir(self.model_dir)
        check_max_model_len(args, self.model_config)
        self.tokenizer = load_tokenizer(self.model_dir)
        # the model runs here (uni) or on tensor-parallel workers (mp, ray): engine/executor/
        self.executor: Executor = make_executor(args, self.model_dir, self.model_config)
        self.runner = self.executor.runner  # None where the ranks run elsewhere
        blocks = self.executor.size_kv_blocks()  # after the weights: on CUDA, what is left
        self.max_model_len = resolve_max_model_len(args, self.model_config, blocks.num_blocks)
        self.executor.init_kv_cache(blocks.num_blocks, blocks.num_host_blocks)
        path = self.executor.kernel_path()
        # the weights in memory (per rank under TP) and what quantization saved; how K/V are
        # stored and what a token of them (and a recurrent layer's state slot) takes
        self.model_stats = {k: path.get(k, 0) for k in ("weights_bytes",
                                                         "quantization_saved_bytes",
                                                         "kv_bytes_per_token",
                                                         "state_bytes_per_slot")}
        self.model_stats["kv_cache_dtype"] = path.get("kv_cache_dtype", args.kv_cache_dtype)
        self.tier = None
        if args.kv_offload_dir is not None or args.kv_offload_url is not None:
            fp = fingerprint(args, self.model_dir, self.model_config, path["dtype"],
                             self.executor.kv_block_formats())
            self.tier = open_tier(args, fp)
        self.kv = make_kv_manager(args, blocks, self.max_model_len, self.model_config, self.tier)
        self.scheduler = Scheduler(args.scheduler_config(self.max_model_len), self.kv)
        if self.executor.drafter is not None:
            self.scheduler.set_draft_token_share(self.executor.drafter.share)
        caching = args.enable_prefix_caching and args.kv_allocator == "paged"
        # a quantized cache's pages hash apart from model-dtype ones (block_hash.py)
        seed = None if args.kv_cache_dtype == "auto" else path.get("kv_cache_dtype")
        hasher = BlockHasher(args.block_size, seed) if caching else None
        self.structured = StructuredOutputs(self.tokenizer, self.model_config.vocab_size)
        self.input_processor = InputProcessor(self.tokenizer, self.model_config,
                                              self.max_model_len, hasher, self.structured)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.requests: dict[str, Request] = {}
        self.last_step_tokens = 0  # tokens the last step computed (prefill and decode)
        self._kv_mapper: KVMapper | None = None  # made on the first kv_map() call
        freeze_gc_heap()  # start-up's objects: no full collection walks them (gc_heap.py)
        keep_freed_memory()  # steps' tensors reuse freed pages, not new ones (malloc_heap.py)

    @property
    def eos_token_id(self) -> int | None:
        return self.input_processor.eos_token_id

    # ---- requests -------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: str | dict,
        params: SamplingParams | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
        beam_params: BeamSearchParams | None = None,
        prepared: Prepared | None = None,
    ) -> Request:
        """`prepared`: the request's costly fields, made ready off this thread (a server's)."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        request = self.input_processor.process(
            request_id, prompt, params, priority=priority, arrival_time=arrival_time,
            beam_params=beam_params, prepared=prepared,
        )
        self.requests[request_id] = request
        self.output_processor.add_request(request)
        self.scheduler.add_request(request)
        return request

    def abort_request(self, request_id: str) -> bool:
        """Abort a request in any state; all its blocks go back to the pool at once."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return False
        self.scheduler.abort_request(request)
        self.output_processor.abort_request(request_id)
        if not self.scheduler.has_unfinished() and not self.executor.dead:
            self.flush_tier_saves()  # no step may come to copy out what it let go of
        return True

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- one step -------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        plan = self.scheduler.schedule()
        # structured outputs: the allowed tokens are computed while the forward pass runs
        plan.grammar_bitmask = self.structured.bitmask(plan, self.scheduler.seqs)
        started = time.perf_counter()
        try:
            out = self.executor.execute(plan)
        except Exception as e:
            self.structured.wait(plan)
            self.scheduler.step_failed(plan)
            raise StepFailed(self.scheduler.request_ids_of(plan), e) from e
        except BaseException:  # KeyboardInterrupt and the like: the caller aborts everything
            self.structured.wait(plan)
            self.scheduler.step_failed(plan)
            raise
        self.scheduler.observe_step_time(plan, time.perf_counter() - started)
        self.last_step_tokens = plan.num_tokens
        updates = self.scheduler.update_from_output(plan, out)
        self.scheduler.apply_text_stops(self.output_processor.process(updates))
        outputs = self.output_processor.make_outputs(updates)
        for progress in self.output_processor.progress:
            if progress.finished:
                self.requests.pop(progress.request_id, None)
        if not self.scheduler.has_unfinished():
            self.flush_tier_saves()
        return outputs

    def flush_tier_saves(self) -> None:
        """Copy out the blocks waiting for the KV tier now (a plan with nothing else in it),
        so that finished requests' blocks reach the tier while the engine idles."""
        plan = self.scheduler.tier_flush_plan()
        if plan is None:
            return
        try:
            out = self.executor.execute(plan)
        except Exception:
            self.kv.tier_io_failed()
            logger.exception("KV tier: copying blocks out failed; they stay in memory only")
            return
        self.kv.tier_io_done(out.saved_blocks)

    @property
    def step_progress(self) -> list[RequestProgress]:
        """Every request the last step touched, with its timestamps, outputs or not."""
        return self.output_processor.progress

    def shutdown(self) -> None:
        """Stop the executor's workers (tensor parallelism), let the KV tier's writer finish
        (up to 10 s), and give what start-up froze back to the garbage collector."""
        if self.tier is not None and not self.executor.dead:
            self.flush_tier_saves()  # what the last aborts let go of
        self.executor.shutdown()
        if self.tier is not None:
            self.tier.close(timeout=10.0)
        gc.unfreeze()

    # ---- introspection --------------------------------------------------------------------
    def kernel_path(self) -> dict:
        """The kernels the model runs on (rank 0's, under tensor parallelism)."""
        return self.executor.kernel_path()

    def stats(self) -> dict[str, int | float | str]:
        return {**self.kv.stats(), **self.scheduler.stats(), **self.model_stats}

    def kv_map(self, contiguous: str | None = "request", block_tables: bool = False) -> dict:
        """The page map now: every block's state, the requests, stats() and the contiguous
        layout of the same traffic (engine/kv_map.py). Call between steps."""
        return self._mapper().snapshot(contiguous, block_tables)

    def kv_map_request(self, request_id: str) -> dict | None:
        """One live request's page-map entry with its block tables (None: not live)."""
        return self._mapper().request(request_id)

    def kv_map_block(self, block_id: int, host: bool = False) -> dict:
        """One block's state and holders (ValueError: no such block)."""
        return self._mapper().block(block_id, host)

    def _mapper(self) -> KVMapper:
        if self._kv_mapper is None:
            # through a weak proxy: a cycle would keep a dropped engine alive once frozen
            self._kv_mapper = KVMapper(weakref.proxy(self))
        return self._kv_mapper

    def check_invariants(self) -> None:
        self.kv.check_invariants()
