"""`octavo serve --data-parallel-size N`: N replicas of `octavo serve` and the router in front.

Each replica is a child `octavo serve` process with the same engine and server flags, on a
free 127.0.0.1 port, with `OMP_NUM_THREADS` set to its share of the cores (the parent's
OMP_NUM_THREADS, or every core the process may use, divided by N; at least 1). On GPUs each
replica gets GPUs of its own (`replica_gpus`): replica i sees only the i-th group of
tensor_parallel_size GPUs counted from the one `--device cuda:N` names (CUDA_VISIBLE_DEVICES,
within the parent's own), and computes on them as `--device cuda`. The router
(launcher.py, prefix policy) runs in this process on the public --host/--port and health-checks
them; /health answers 503 until a replica is up.

- A replica that exits is marked down at once (no traffic); when every replica has exited,
  the router stops and `serve` exits 1, so a supervisor can restart the whole.
- SIGTERM/SIGINT: the router stops accepting connections and each replica gets one SIGTERM,
  so they drain together (in-flight requests finish within --shutdown-timeout); then `serve`
  waits for the replicas (killing those still alive after --shutdown-timeout + 10 s) and
  exits 0. The replicas run in their own session, so a terminal's Ctrl-C reaches only this
  process, and they get SIGTERM if it dies (PR_SET_PDEATHSIG, Linux).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import ctypes.util
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import octavo.engine_args as engine_args
import octavo.envs as envs
from octavo.model.sources import resolve_model_dir
from octavo.router.args import RouterConfig
from octavo.router.launcher import RouterServer, make_hasher, router_server
from octavo.server.args import add_server_args
from octavo.server.launcher import server_config

# the parent's own flags: never passed on to a replica
PARENT_ONLY = frozenset({"host", "port", "data_parallel_size", "help"})
PR_SET_PDEATHSIG = 1

_libc: Any = None
with contextlib.suppress(OSError, TypeError):
    _libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)


def _die_with_parent() -> None:  # runs in the child between fork and exec
    if _libc is not None and sys.platform.startswith("linux"):
        _libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def replica_flags(ns: argparse.Namespace) -> list[str]:
    """`octavo serve`'s flags as given (those that differ from their defaults), less the
    parent's own: the engine's through engine_args.to_cli_flags, the server's by their
    argparse actions."""
    defaults = engine_args.EngineArgs()
    given = {name: value for name, value in engine_args.cli_overrides(ns).items()
             if value != getattr(defaults, name)}
    out = engine_args.to_cli_flags(given)
    parser = argparse.ArgumentParser(add_help=False)
    add_server_args(parser)
    for action in parser._actions:  # argparse's own list of what it parses
        if action.dest in PARENT_ONLY or not hasattr(ns, action.dest):
            continue
        value = getattr(ns, action.dest)
        if value == action.default:
            continue
        flag = action.option_strings[0]
        if isinstance(value, bool):  # --x / --no-x
            out.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, list):
            out += [flag, *map(str, value)]
        else:
            out += [flag, str(value)]
    return out


def threads_per_replica(n: int) -> int:
    cores = envs.omp_num_threads() or len(os.sched_getaffinity(0))
    return max(1, cores // n)


@dataclass
class ReplicaProcess:
    url: str
    proc: subprocess.Popen
    signalled: bool = False

    def terminate(self) -> None:
        if self.proc.poll() is None and not self.signalled:
            self.signalled = True
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)


def replica_gpus(device: str, n: int, per_replica: int, visible: list[str] | None = None,
                 count: int | None = None) -> list[str] | None:
    """Each replica's CUDA_VISIBLE_DEVICES on GPUs (None on CPU): disjoint groups of
    `per_replica` of the GPUs this process sees (`visible`, default CUDA_VISIBLE_DEVICES or
    every one of `count`, default torch's count), from the index `device` names."""
    if not device.startswith("cuda"):
        return None
    base = int(device.partition(":")[2] or 0)
    if visible is None:
        visible = envs.cuda_visible_devices()
    if visible is None:
        if count is None:
            import torch

            count = torch.cuda.device_count()
        visible = [str(i) for i in range(count)]
    need = n * per_replica
    if base + need > len(visible):
        raise ValueError(f"--data-parallel-size {n} with {per_replica} GPU(s) per replica "
                         f"needs {need} GPUs from cuda:{base}, and this process sees "
                         f"{len(visible)} ({','.join(visible) or 'none'})")
    return [",".join(visible[base + i * per_replica: base + (i + 1) * per_replica])
            for i in range(n)]


def on_own_gpus(flags: list[str]) -> list[str]:
    """A replica's flags with `--device cuda`: the first GPU it sees is its own."""
    out, i = [], 0
    while i < len(flags):
        if flags[i] == "--device":
            i += 2
            continue
        out.append(flags[i])
        i += 1
    return [*out, "--device", "cuda"]


def start_replicas(ns: argparse.Namespace, n: int,
                   gpus: list[str] | None = None) -> list[ReplicaProcess]:
    """`gpus`: each replica's CUDA_VISIBLE_DEVICES (replica_gpus), None on CPU."""
    flags = replica_flags(ns)
    env = envs.child_env({"OMP_NUM_THREADS": str(threads_per_replica(n))})
    replicas = []
    try:
        for i in range(n):
            port = free_port()
            if gpus is not None:
                env = {**env, "CUDA_VISIBLE_DEVICES": gpus[i]}
            cmd = [sys.executable, "-m", "octavo.cli", "serve",
                   *(on_own_gpus(flags) if gpus is not None else flags), "--host", "127.0.0.1",
                   "--port", str(port)]
            proc = subprocess.Popen(cmd, env=env, start_new_session=True,
                                    preexec_fn=_die_with_parent)
            replicas.append(ReplicaProcess(f"http://127.0.0.1:{port}", proc))
    except BaseException:
        stop_replicas(replicas, timeout=10)
        raise
    return replicas


def stop_replicas(replicas: list[ReplicaProcess], timeout: float) -> None:
    for r in replicas:
        r.terminate()
    for r in replicas:
        try:
            r.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            r.proc.kill()
            r.proc.wait()


def watch(replicas: list[ReplicaProcess], public_url: str) -> Callable[[RouterServer], None]:
    """The router's tick: says when every replica is first up; a replica whose process exited
    is marked down; when none is left, the router stops with status 1."""
    exited: set[str] = set()
    ready = [False]

    def tick(server: RouterServer) -> None:
        router = server.config.app.state.router
        if not ready[0] and len(router.replicas.healthy()) == len(replicas):
            ready[0] = True
            print(f"octavo serve: {len(replicas)} replicas ready behind {public_url}",
                  file=sys.stderr, flush=True)
        for r in replicas:
            code = r.proc.poll()
            if code is not None and r.url not in exited:
                exited.add(r.url)
                router.replicas.mark_down(router.replicas.by_url(r.url),
                                          f"its process exited with status {code}")
        if len(exited) == len(replicas):
            print("octavo serve: every replica has exited; stopping", file=sys.stderr,
                  flush=True)
            server.exit_code = 1
            server.should_exit = True
    return tick


def serve_data_parallel(ns: argparse.Namespace) -> int:
    n = ns.data_parallel_size
    if n < 1:
        raise ValueError(f"--data-parallel-size must be >= 1, got {n}")
    # a bad engine flag, or too few GPUs, fails here, before any process starts
    args = engine_args.from_cli_args(ns)
    gpus = replica_gpus(args.device, n, args.tensor_parallel_size)
    server = server_config(ns)
    resolve_model_dir(ns.model)  # a GGUF is converted once, here, not by N replicas at once
    replicas = start_replicas(ns, n, gpus)
    try:
        config = RouterConfig(
            replicas=[r.url for r in replicas], model=ns.model, block_size=ns.block_size,
            max_request_body_bytes=server.max_request_body_bytes,
            enable_auto_tool_choice=server.enable_auto_tool_choice,
            tool_call_parser=server.tool_call_parser,
            shutdown_timeout=server.shutdown_timeout,
            kv_tier_shared=getattr(ns, "kv_offload_dir", None) is not None
            or getattr(ns, "kv_offload_url", None) is not None)
        router = router_server(config, make_hasher(config), host=ns.host, port=ns.port,
                               log_level=ns.uvicorn_log_level)

        def drain_replicas() -> None:
            for r in replicas:
                r.terminate()

        router.on_signal = drain_replicas
        router.tick = watch(replicas, f"http://{ns.host}:{ns.port}")
        on = "" if gpus is None else f", GPUs {' | '.join(gpus)}"
        print(f"octavo serve: {n} replicas ({', '.join(r.url for r in replicas)}, "
              f"{threads_per_replica(n)} threads each{on}) behind the router on "
              f"http://{ns.host}:{ns.port} (policy prefix; /health is 503 until one is up)",
              file=sys.stderr, flush=True)
        router.run()
        return router.exit_code
    finally:
        stop_replicas(replicas, timeout=server.shutdown_timeout + 10)
