"""The one thread that does all of a server's torch work: it builds the model, then steps it.

Why one thread: torch's CPU kernels run on OpenMP (libgomp), and libgomp keeps a separate thread
team for every thread that enters a parallel region. A server that loads the model on the main
thread and steps it on an engine thread has two teams, so it manages twice as many OpenMP
threads as there are CPUs. libgomp then *throttles* its spin-waiting: between the model's many
short parallel regions the workers go to sleep and must be woken by a futex, and the cores idle.
Measured on 2 cores (the same engine, workload `mixed` 32 x 64 tokens): stepped on the thread
that built it, 1.99 cores busy; stepped on a second thread, 1.76 busy and 14% fewer tokens/s.
Building the engine on the thread that will step it keeps the process at one team.

The thread is a daemon: a server that exits with the engine still busy does not hang on it.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")


class EngineThread:
    """A daemon thread running submitted calls one at a time, in order (a one-thread executor
    whose thread never blocks interpreter exit)."""

    def __init__(self, name: str = "octavo-engine") -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._closed = False
        self._thread.start()

    def submit(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> Future[T]:
        if self._closed:
            raise RuntimeError("the engine thread is closed")
        future: Future[T] = Future()
        self._jobs.put((fn, args, kwargs, future))
        return future

    def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run fn on the thread and wait for its result (its exception is raised here)."""
        return self.submit(fn, *args, **kwargs).result()

    def close(self) -> None:
        """No more calls; the thread ends after the ones already queued."""
        if not self._closed:
            self._closed = True
            self._jobs.put(None)

    @property
    def ident(self) -> int | None:
        return self._thread.ident

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fn, args, kwargs, future = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args, **kwargs))
            except BaseException as e:  # handed to whoever waits on the future
                future.set_exception(e)
