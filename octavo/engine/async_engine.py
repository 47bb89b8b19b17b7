"""The engine behind the server: one background thread drives LLMEngine; asyncio talks to it.

LLMEngine is not thread-safe and a model step can take hundreds of milliseconds, so neither may
run on the event loop. The split:

- the *engine thread* (engine/engine_thread.py) is the only caller of LLMEngine; `octavo serve`
  builds the engine on that same thread, so all torch work of the process runs on one thread
  and torch keeps one OpenMP team (two teams cost 14% of the throughput, see there). Before
  each step it drains a command queue (add / abort / abort-all / stop), then steps, then hands
  every output of the step to the event loop in ONE `loop.call_soon_threadsafe` call (a call
  per output would flood the loop's self-pipe with 200 streams running);
- the *event loop* enqueues commands and awaits per-request `RequestStream`s. `add_request`
  awaits the engine thread's verdict, so a bad prompt (empty, too long, ids out of range) comes
  back as the engine's own ValueError before an HTTP response has started.

When a stream's consumer lags, the stream keeps one pending item: the newest cumulative
output, or the merge of the DELTA outputs it has not handed out yet. A slow client never holds
the engine back, and costs at most the tokens it has not read.

Failures stay contained: a model step that raises fails only the requests of that step (the
others, waiting, go on); only a bug in this loop itself stops the thread, which the server
notices (/health fails, `serve` exits 1). `begin_drain` refuses new requests and lets those in
flight finish; `begin_shutdown` aborts them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

from octavo.engine.engine import LLMEngine, StepFailed
from octavo.engine.engine_thread import EngineThread
from octavo.engine.executor import WorkerDiedError
from octavo.engine.input_processor import Prepared
from octavo.engine.structured_output import StructuredOutputs
from octavo.outputs import RequestOutput, RequestProgress
from octavo.sampling_params import RequestOutputKind, SamplingParams

T = TypeVar("T")

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """What a front end needs to know of the model an engine serves."""

    model_dir: Path
    max_model_len: int
    vocab_size: int
    max_num_seqs: int
    scheduling_policy: str
    # the KV cache's settings under vLLM's CacheConfig names (`vllm:cache_config_info`)
    cache_config: tuple[tuple[str, object], ...] = ()
    # the engine's tokenizer, for a front end to share: a large vocabulary's tokenizer takes
    # hundreds of MB (Gemma 3's 262k tokens: 275 MB). Only read (encode, decode, templates),
    # never reconfigured (truncation, padding), so threads may use it at once.
    tokenizer: Any = None


class RequestAbortedError(RuntimeError):
    """The request was aborted by the server (shutdown) before it finished."""


class EngineStepError(RuntimeError):
    """A model step failed; every request in flight at that moment fails with this error.

    Its text is what a client may see: generic, with the request id to find the log line that
    says what happened (the cause's own text stays in the log: it can name files, shapes and
    other requests' state)."""

    def __init__(self, request_id: str | None = None) -> None:
        where = f" (request {request_id})" if request_id else ""
        super().__init__(f"the model step failed{where}; the server log has the details")
        self.request_id = request_id


class OutputObserver(Protocol):
    """Sees every request each step touched, on the engine thread, for metrics (must be
    thread-safe and quick); `prev_token_time`: its last_token_time at its previous step."""

    def on_progress(self, progress: RequestProgress, prev_token_time: float | None) -> None: ...

    def on_step(self, num_tokens: int) -> None:
        """After each step that ran, with the tokens it computed."""


class RequestStream:
    """Async iterator over one request's outputs; when behind, the newest cumulative output or
    the merged deltas.

    Fed on the event loop by the engine thread's batched callback; the last item is a finished
    output or an exception.
    """

    def __init__(self, request_id: str, owner: AsyncLLMEngine, delta: bool = False) -> None:
        self.request_id = request_id
        self.delta = delta  # its request asked for DELTA outputs
        self._owner = owner
        self._latest: RequestOutput | BaseException | None = None
        self._ready = asyncio.Event()
        self.finished = False

    def _put(self, item: RequestOutput | BaseException) -> None:
        if isinstance(self._latest, BaseException):
            return  # an error is final
        if (self.delta and isinstance(item, RequestOutput)
                and isinstance(self._latest, RequestOutput)):
            self._latest.add(item)  # deltas add up; a cumulative output replaces the last
        else:
            self._latest = item
        self._ready.set()

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        await self._ready.wait()
        self._ready.clear()
        item, self._latest = self._latest, None
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        assert item is not None
        if item.finished:
            self.finished = True
        return item

    def cancel(self) -> None:
        """Abort the request in the engine unless it already finished (idempotent)."""
        if not self.finished:
            self.finished = True
            self._owner.abort(self.request_id)


@dataclass(slots=True)
class NewRequest:
    request_id: str
    prompt: str | dict
    params: SamplingParams
    priority: int = 0
    prepared: Prepared | None = None  # its costly fields, made ready off the engine thread


@dataclass(slots=True)
class _Add:
    """Several requests in one command: the engine takes all of them, or none."""

    requests: list[NewRequest]
    streams: list[RequestStream]
    future: asyncio.Future


@dataclass(slots=True)
class _Abort:
    request_id: str


@dataclass(slots=True)
class _AbortAll:
    error: BaseException


@dataclass(slots=True)
class _Call:
    """Run `fn(engine)` on the engine thread between two steps; its result answers `future`."""

    fn: Callable[[LLMEngine], Any]
    future: asyncio.Future


@dataclass(slots=True)
class _Stop:
    pass


class AsyncLLMEngine:
    """Runs an LLMEngine on a background thread behind an asyncio interface."""

    def __init__(self, engine: LLMEngine, observer: OutputObserver | None = None,
                 thread: EngineThread | None = None) -> None:
        """`thread`: the thread that built `engine`, to step it on (None: a new thread)."""
        self.engine = engine
        args = engine.args
        cache = {
            "block_size": args.block_size,
            # how K/V are stored: the model dtype's name for auto, else int8 / fp8_e4m3 / ...
            "cache_dtype": engine.stats().get("kv_cache_dtype", args.kv_cache_dtype),
            "enable_prefix_caching": args.enable_prefix_caching,
            "gpu_memory_utilization": args.gpu_memory_utilization,
            "num_gpu_blocks": engine.kv.num_blocks,
            "num_cpu_blocks": getattr(getattr(engine.kv, "cpu_pool", None), "num_blocks", 0),
            "swap_space": args.swap_space or 0,
        }
        self.model_info = ModelInfo(engine.model_dir, engine.max_model_len,
                                    engine.model_config.vocab_size, args.max_num_seqs,
                                    args.scheduling_policy, tuple(cache.items()),
                                    engine.tokenizer)
        # the constraint compiler: thread-safe, so a front end's worker thread compiles a
        # request's matcher (input_processor.Prepared) and the engine thread never waits on it
        self.structured: StructuredOutputs = engine.structured
        self.observer = observer
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._given_thread = thread
        self._thread: EngineThread | None = None
        self._loop_done: Future | None = None
        self._accepting = False
        self._pending_adds = 0  # event-loop side: adds enqueued, not yet answered
        self._pending_calls: set[asyncio.Future] = set()  # event-loop side: call() in transit
        # engine-thread side; read (never written) by the loop: plain values, atomic under GIL
        self._streams: dict[str, RequestStream] = {}
        self._last_token_time: dict[str, float | None] = {}
        self._stats: dict[str, int | float | str] = engine.stats()
        self._num_waiting = 0

    # ---- lifecycle (event loop) -----------------------------------------------------------
    def start(self) -> None:
        """Start the engine thread; call from the event loop that will consume outputs."""
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._accepting = True
        self._thread = self._given_thread or EngineThread()
        self._loop_done = self._thread.submit(self._run)

    def begin_drain(self) -> None:
        """Refuse new requests; those in flight go on (a graceful shutdown). Thread-safe."""
        self._accepting = False

    def begin_shutdown(self) -> None:
        """Refuse new requests and abort those in flight (their streams raise). Thread-safe."""
        self._accepting = False
        self._commands.put(_AbortAll(RequestAbortedError("the server is shutting down")))

    async def stop(self) -> None:
        """Abort everything, stop the engine thread and wait for it."""
        if self._thread is None:
            return
        self.begin_shutdown()
        self._commands.put(_Stop())
        assert self._loop_done is not None
        with contextlib.suppress(Exception):  # a loop that died has logged why
            await asyncio.wrap_future(self._loop_done)
        for future in list(self._pending_calls):  # queued behind the stop: never run
            if not future.done():
                future.set_exception(RuntimeError("the engine stopped"))
        # the executor's workers (tensor parallelism), stopped on the thread that steps them
        with contextlib.suppress(Exception):
            await asyncio.wrap_future(self._thread.submit(self.engine.shutdown))
        self._thread.close()
        self._thread = None

    @property
    def is_running(self) -> bool:
        return self._loop_done is not None and not self._loop_done.done()

    @property
    def accepting(self) -> bool:
        return self._accepting and self.is_running and self.dead is None

    @property
    def dead(self) -> str | None:
        """Why the engine can run no more steps (a tensor-parallel worker died), or None."""
        return self.engine.executor.dead

    # ---- requests (event loop) ------------------------------------------------------------
    async def add_request(
        self, request_id: str, prompt: str | dict, params: SamplingParams, priority: int = 0
    ) -> RequestStream:
        """Queue a request; returns its stream once the engine accepted it.

        Raises the engine's ValueError for a bad prompt, RequestAbortedError when shutting down.
        """
        streams = await self.add_requests([NewRequest(request_id, prompt, params, priority)])
        return streams[0]

    async def add_requests(self, requests: list[NewRequest]) -> list[RequestStream]:
        """Queue several requests in one command (one round trip to the engine thread, all in
        the same step); all are accepted or none (the first error is raised)."""
        if not self.accepting:
            raise RequestAbortedError(self.dead or "the server is shutting down")
        assert self._loop is not None
        streams = [RequestStream(r.request_id, self,
                                 r.params.output_kind == RequestOutputKind.DELTA)
                   for r in requests]
        future = self._loop.create_future()
        self._pending_adds += len(requests)
        self._commands.put(_Add(list(requests), streams, future))
        try:
            await future
        except asyncio.CancelledError:
            # The caller went away while the engine thread was busy: the adds may have landed.
            for r in requests:
                self.abort(r.request_id)
            raise
        finally:
            self._pending_adds -= len(requests)
        return streams

    def abort(self, request_id: str) -> None:
        """Abort a request (no-op if unknown or finished); its blocks free before next step."""
        self._commands.put(_Abort(request_id))

    @property
    def num_in_flight(self) -> int:
        """Requests added and not finished yet (adds in transit included)."""
        return len(self._streams) + self._pending_adds

    @property
    def num_waiting(self) -> int:
        """Requests not yet scheduled: the scheduler's waiting queue plus adds in transit."""
        return self._num_waiting + self._pending_adds

    def stats(self) -> dict[str, int | float | str]:
        """engine.stats() as of the end of the engine thread's last iteration."""
        return self._stats

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """`fn(engine)` run on the engine thread between two steps (it must not step or
        change requests: a read, like kv_map); raises what it raised."""
        if not self.is_running:
            raise RuntimeError("the engine is not running")
        assert self._loop is not None
        future = self._loop.create_future()
        self._pending_calls.add(future)
        future.add_done_callback(self._pending_calls.discard)
        self._commands.put(_Call(fn, future))
        return await future

    # ---- engine thread --------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                idle = not self.engine.has_unfinished_requests()
                if not self._drain(block=idle):
                    return
                if self.engine.has_unfinished_requests():
                    self._step()
                self._publish_stats()
        except BaseException:  # pragma: no cover - a bug in this loop; keep the traceback
            logger.exception("the engine thread died; failing every request in flight: %s",
                              ", ".join(self._streams) or "none")
            self._accepting = False
            self._fail_all()
            raise

    def _drain(self, block: bool) -> bool:
        """Run queued commands; wait for one first when idle. False when asked to stop."""
        try:
            cmd = self._commands.get() if block else self._commands.get_nowait()
        except queue.Empty:
            return True
        while True:
            if isinstance(cmd, _Stop):
                return False
            self._execute(cmd)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _execute(self, cmd: Any) -> None:
        if isinstance(cmd, _Add):
            added: list[str] = []
            try:
                if not self._accepting or self.dead is not None:
                    raise RequestAbortedError(self.dead or "the server is shutting down")
                for r in cmd.requests:
                    self.engine.add_request(r.request_id, r.prompt, r.params, r.priority,
                                            prepared=r.prepared)
                    added.append(r.request_id)
            except Exception as e:  # ValueError/TypeError for bad input: the caller's 400
                for rid in added:
                    self.engine.abort_request(rid)
                self._call_soon(_set_exception, cmd.future, e)
                return
            for r, stream in zip(cmd.requests, cmd.streams, strict=True):
                self._streams[r.request_id] = stream
                self._last_token_time[r.request_id] = None
            self._call_soon(_set_result, cmd.future, None)
        elif isinstance(cmd, _Abort):
            self._forget(cmd.request_id)
            self.engine.abort_request(cmd.request_id)
        elif isinstance(cmd, _AbortAll):
            self._fail_all(lambda _: cmd.error)
        elif isinstance(cmd, _Call):
            try:
                result = cmd.fn(self.engine)
            except Exception as e:
                self._call_soon(_set_exception, cmd.future, e)
            else:
                self._call_soon(_set_result, cmd.future, result)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except StepFailed as e:
            if isinstance(e.__cause__, WorkerDiedError):  # nothing can run any more: fail all
                logger.error("engine is dead: %s; failing every request: %s", e.__cause__,
                             ", ".join(self._streams) or "none")
                self._fail_all()
                return
            # only the requests of that step fail; the others, waiting, go on
            logger.error("engine step failed (%s); failing its %d requests: %s", e.__cause__,
                         len(e.request_ids), ", ".join(e.request_ids), exc_info=e.__cause__)
            failed = [(rid, self._streams.get(rid)) for rid in e.request_ids]
            for rid, _ in failed:
                self._forget(rid)
                self.engine.abort_request(rid)
            batch = [(s, EngineStepError(rid)) for rid, s in failed if s is not None]
            if batch:
                self._call_soon(_deliver, batch)
            return
        except Exception:
            logger.exception("engine step failed; failing the requests in flight: %s",
                             ", ".join(self._streams) or "none")
            self._fail_all()
            return
        if self.observer is not None:
            try:
                self.observer.on_step(self.engine.last_step_tokens)
            except Exception:  # metrics must never take the engine down
                logger.exception("output observer failed")
        for progress in self.engine.step_progress:
            rid = progress.request_id
            if rid not in self._streams:
                continue  # aborted between the step's schedule and its output
            if self.observer is not None:
                try:
                    self.observer.on_progress(progress, self._last_token_time.get(rid))
                except Exception:  # metrics must never take the engine down
                    logger.exception("output observer failed")
            self._last_token_time[rid] = progress.metrics.get("last_token_time")
        batch: list[tuple[RequestStream, RequestOutput | BaseException]] = []
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if out.finished:
                self._forget(out.request_id)
            batch.append((stream, out))
        if batch:
            self._call_soon(_deliver, batch)

    def _fail_all(self, error_of: Callable[[str], BaseException] = EngineStepError) -> None:
        """Fail every request in flight, each with `error_of(its id)`."""
        streams = list(self._streams.items())
        for rid, _ in streams:
            self._forget(rid)
            self.engine.abort_request(rid)
        if streams:
            self._call_soon(_deliver, [(s, error_of(rid)) for rid, s in streams])

    def _forget(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
        self._last_token_time.pop(request_id, None)

    def _publish_stats(self) -> None:
        self._stats = self.engine.stats()
        self._num_waiting = int(self._stats.get("num_requests_waiting", 0))

    def _call_soon(self, fn: Callable[..., None], *args: Any) -> None:
        assert self._loop is not None
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is left to tell
            self._loop.call_soon_threadsafe(fn, *args)


def _set_result(future: asyncio.Future, value: Any) -> None:
    if not future.done():
        future.set_result(value)


def _set_exception(future: asyncio.Future, error: BaseException) -> None:
    if not future.done():
        future.set_exception(error)


def _deliver(batch: list[tuple[RequestStream, RequestOutput | BaseException]]) -> None:
    for stream, item in batch:
        stream._put(item)
