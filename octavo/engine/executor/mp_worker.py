"""A worker process of the `mp` executor: `python -m octavo.engine.executor.mp_worker RANK SIZE`
with OCTAVO_WORKER_ADDRESS and OCTAVO_WORKER_AUTHKEY set by the executor (mp.py).

It connects back, sends its rank, then answers calls until its connection closes: each call is
a pickled (method, args) of Worker, each reply ("ok", value) or ("err", "Type: message"). A
plan with a grammar bitmask is followed by one more message for rank 0: the bitmask itself,
read when the sampler asks for it (so the forward pass runs while the engine computes it).
"""

from __future__ import annotations

import contextlib
import logging
import pickle
import sys
import traceback
from multiprocessing.connection import Client, Connection
from typing import Any

import octavo.envs as envs
from octavo.model.worker.tp_worker import Worker
from octavo.step_plan import StepPlan

logger = logging.getLogger("octavo.engine.executor.mp_worker")


class PipeBitmask:
    """The bitmask that follows a plan on the connection, read on first use (once)."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.read = False
        self.value: Any = None
        self.error: str | None = None

    def result(self) -> Any:
        if not self.read:
            self.read = True
            kind, value = pickle.loads(self.conn.recv_bytes())
            if kind == "ok":
                self.value = value
            else:
                self.error = value
        if self.error is not None:
            raise RuntimeError(f"grammar bitmask: {self.error}")
        return self.value


def serve(conn: Connection, worker: Worker) -> None:
    while True:
        try:
            method, args = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):  # the executor closed the connection or died
            return
        bitmask = None
        if method == "execute" and worker.rank == 0:
            plan: StepPlan = args[0]
            if plan.grammar_bitmask is not None:
                bitmask = PipeBitmask(conn)
                plan.grammar_bitmask.pending = bitmask
        try:
            reply: tuple[str, Any] = ("ok", getattr(worker, method)(*args))
        except Exception as e:
            logger.error("rank %d: %s failed:\n%s", worker.rank, method, traceback.format_exc())
            reply = ("err", f"{type(e).__name__}: {e}")
        if bitmask is not None and not bitmask.read:  # failed before sampling: drain it
            with contextlib.suppress(RuntimeError):
                bitmask.result()
        conn.send_bytes(pickle.dumps(reply))


def main() -> int:
    rank, size = int(sys.argv[1]), int(sys.argv[2])
    logging.basicConfig(level=envs.log_level(),
                        format=f"%(asctime)s rank{rank} %(levelname)s %(name)s: %(message)s")
    host, port, authkey = envs.worker_rendezvous()
    conn = Client((host, port), authkey=authkey)
    conn.send(rank)
    worker = Worker(rank, size)
    try:
        serve(conn, worker)
    finally:
        worker.close()
        conn.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
