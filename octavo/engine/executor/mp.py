"""The `mp` executor: one worker process per tensor-parallel rank on this machine.

The workers are started as `python -m octavo.engine.executor.mp_worker` (no fork of a process
that already runs threads, and no re-import of the user's script as `multiprocessing`'s spawn
would do). Each connects back to a listener of this process (an authenticated
`multiprocessing.connection`), then they join one gloo group (NCCL on CUDA) for the
collectives of the forward pass.

A call goes to every rank and waits for every rank's reply. A closed connection means the
worker died: the executor is dead from then on (`WorkerDiedError`, naming the rank and its
pid), and the other workers are stopped. An error on some ranks but not all leaves the group's
collectives out of step, so it is fatal too; an error on every rank (a bad plan, found before
any collective) fails only that call.
"""

from __future__ import annotations

import contextlib
import logging
import pickle
import secrets
import socket
import subprocess
import sys
import threading
import time
import weakref
from multiprocessing.connection import Connection, Listener, wait
from pathlib import Path
from typing import Any

import octavo.envs as envs
from octavo.config import ModelConfig
from octavo.engine.executor.base import RankedExecutor, WorkerDiedError, settle_errors
from octavo.engine_args import EngineArgs
from octavo.model.worker.tp_worker import ERROR_GRACE_S, accepted_drafts, strip_bitmask
from octavo.step_plan import RunnerOutput, StepPlan

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 600  # loading a large model's shards


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _stop(procs: list[subprocess.Popen], conns: list[Connection]) -> None:
    """Close the connections (a worker exits when its connection closes), then reap; a
    worker still busy (waiting in a collective for a rank that died) is terminated."""
    for conn in conns:
        with contextlib.suppress(OSError):
            conn.close()
    for signal_after, stop in ((2.0, subprocess.Popen.terminate), (3.0, subprocess.Popen.kill)):
        deadline = time.monotonic() + signal_after
        for p in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(max(0.01, deadline - time.monotonic()))
        for p in procs:
            if p.poll() is None:
                stop(p)
    for p in procs:
        p.wait()


class MultiprocExecutor(RankedExecutor):
    name = "mp"

    def __init__(self, args: EngineArgs, model_dir: Path, config: ModelConfig) -> None:
        self.size = args.tensor_parallel_size
        self._accepted: dict[int, list[int]] = {}
        authkey = secrets.token_bytes(32)
        self._listener = Listener(("127.0.0.1", 0), authkey=authkey)
        host, port = self._listener.address
        env = envs.child_env({"OCTAVO_WORKER_ADDRESS": f"{host}:{port}",
                              "OCTAVO_WORKER_AUTHKEY": authkey.hex()})
        self._procs = [
            subprocess.Popen([sys.executable, "-m", "octavo.engine.executor.mp_worker",
                              str(rank), str(self.size)], env=env)
            for rank in range(self.size)]
        self._conns: list[Connection] = []
        self._finalizer = weakref.finalize(self, _stop, self._procs, self._conns)
        try:
            self._conns.extend(self._accept())
            init_method = f"tcp://127.0.0.1:{free_port()}"
            self._call_all("init", args, model_dir, config, init_method)
        except BaseException:
            self.shutdown()
            raise
        logger.info("mp executor: %d tensor-parallel workers, pids %s", self.size,
                    self.worker_pids())

    # ---- start-up -------------------------------------------------------------------------
    def _accept(self) -> list[Connection]:
        """Each worker's connection, in rank order (the worker sends its rank first)."""
        accepted: list[Connection] = []
        failure: list[BaseException] = []

        def accept() -> None:
            try:
                for _ in range(self.size):
                    accepted.append(self._listener.accept())
            except BaseException as e:  # the listener closed under us, or a bad key
                failure.append(e)

        thread = threading.Thread(target=accept, name="octavo-mp-accept", daemon=True)
        thread.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while thread.is_alive():
            thread.join(0.2)
            for rank, p in enumerate(self._procs):
                if p.poll() is not None:
                    self._listener.close()
                    raise WorkerDiedError(f"tensor-parallel worker rank {rank} (pid {p.pid}) "
                                          f"exited with code {p.returncode} while starting")
            if time.monotonic() > deadline:
                self._listener.close()
                raise WorkerDiedError(f"the tensor-parallel workers did not connect within "
                                      f"{START_TIMEOUT_S} s")
        self._listener.close()
        if failure:
            raise WorkerDiedError(f"a tensor-parallel worker failed to connect: {failure[0]}")
        by_rank: dict[int, Connection] = {}
        for conn in accepted:
            by_rank[int(conn.recv())] = conn
        return [by_rank[r] for r in range(self.size)]

    # ---- calls ----------------------------------------------------------------------------
    def _send(self, rank: int, message: bytes) -> None:
        try:
            self._conns[rank].send_bytes(message)
        except OSError:
            self._died(rank)

    def _died(self, rank: int) -> None:
        p = self._procs[rank]
        try:
            code = p.wait(2)
        except subprocess.TimeoutExpired:
            code = None
        self._fail(f"tensor-parallel worker rank {rank} (pid {p.pid}) died"
                   + (f" (exit code {code})" if code is not None else ""))

    def _collect(self) -> list[Any]:
        """Every rank's reply to the call just sent."""
        replies: dict[int, tuple[str, Any]] = {}
        pending = {self._conns[r]: r for r in range(self.size)}
        first_error: float | None = None
        while pending:
            timeout = None if first_error is None else max(
                0.0, first_error + ERROR_GRACE_S - time.monotonic())
            ready = wait(list(pending), timeout)
            if not ready:  # some ranks stuck in a collective the failed ones never joined
                break
            for conn in ready:
                rank = pending.pop(conn)  # type: ignore[index]
                try:
                    replies[rank] = pickle.loads(conn.recv_bytes())  # type: ignore[union-attr]
                except (EOFError, OSError):
                    self._died(rank)
                if replies[rank][0] == "err" and first_error is None:
                    first_error = time.monotonic()
        try:
            settle_errors({r: v for r, (kind, v) in replies.items() if kind == "err"},
                          self.size)
        except WorkerDiedError as e:
            self._fail(str(e))
        return [replies[r][1] for r in range(self.size)]

    def _call_all(self, method: str, *args: Any) -> list[Any]:
        if self.dead is not None:
            raise WorkerDiedError(self.dead)
        message = pickle.dumps((method, args))
        for rank in range(self.size):
            self._send(rank, message)
        return self._collect()

    # ---- the executor's calls ---------------------------------------------------------------
    def execute(self, plan: StepPlan) -> RunnerOutput:
        if self.dead is not None:
            raise WorkerDiedError(self.dead)
        gb = plan.grammar_bitmask
        sent = strip_bitmask(plan)
        rank_plans = self._rank_plans(sent)
        if rank_plans is None:
            message = pickle.dumps(("execute", (sent, self._accepted)))
            messages = [message] * self.size
        else:  # each rank gets its own slice of the KV tier's loads
            messages = [pickle.dumps(("execute", (p, self._accepted))) for p in rank_plans]
        self._accepted = {}
        for rank in range(self.size):
            self._send(rank, messages[rank])
        if gb is not None:  # computed while the workers run the forward; rank 0 samples
            try:
                grammar: tuple[str, Any] = ("ok", gb.pending.result())
            except Exception as e:  # rank 0 raises it where it samples
                grammar = ("err", f"{type(e).__name__}: {e}")
            self._send(0, pickle.dumps(grammar))
        out = self._step_output(plan, self._collect())
        self._accepted = accepted_drafts(plan, out)
        return out

    def worker_pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def shutdown(self) -> None:
        self._finalizer()
