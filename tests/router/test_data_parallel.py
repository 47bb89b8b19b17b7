"""`octavo serve --data-parallel-size 2` as a user runs it: a process with two replica
processes behind the router; a replica that dies is reported, SIGTERM stops all of them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from octavo.router.data_parallel import (
    free_port,
    replica_flags,
    replica_gpus,
    threads_per_replica,
)


def children(pid: int) -> list[int]:
    return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def wait_for(check, timeout: float = 120.0, what: str = ""):
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def health(url: str) -> dict | None:
    try:
        return httpx.get(f"{url}/health", timeout=5).json()
    except httpx.HTTPError:
        return None


def test_serve_data_parallel_runs_replicas_behind_the_router(tiny_llama_dir, tmp_path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(tmp_path / "serve.log", "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [sys.executable, "-m", "octavo.cli", "serve", "--data-parallel-size", "2",
         "--model", str(tiny_llama_dir), "--num-kv-blocks", "64", "--port", str(port),
         "--served-model-name", "tiny", "--uvicorn-log-level", "warning"],
        stdout=log, stderr=subprocess.STDOUT,
        env={**os.environ, "OMP_NUM_THREADS": "2", "HF_HUB_OFFLINE": "1"})
    replicas: list[int] = []
    try:
        body = wait_for(lambda: (h := health(url)) and h["healthy_replicas"] == 2 and h,
                        what="two healthy replicas")
        replicas = children(proc.pid)
        assert len(replicas) == 2
        assert all(s["kv_blocks"] == 64 for s in body["replicas"])
        r = httpx.post(f"{url}/v1/completions", timeout=60, json={
            "model": "tiny", "prompt": "hello", "max_tokens": 3, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        # a replica dies: the router marks it down at once, the other one serves
        os.kill(replicas[0], signal.SIGKILL)
        body = wait_for(lambda: (h := health(url)) and h["healthy_replicas"] == 1 and h,
                        timeout=10, what="the dead replica marked down")
        down = [s for s in body["replicas"] if not s["healthy"]]
        assert len(down) == 1 and "exited" in down[0]["error"]
        for _ in range(3):
            r = httpx.post(f"{url}/v1/completions", timeout=60, json={
                "model": "tiny", "prompt": "again", "max_tokens": 1})
            assert r.status_code == 200
            assert body["replicas"][int(r.headers["x-octavo-replica"])]["healthy"]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        assert not any(alive(pid) for pid in replicas)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid in replicas:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        log.close()
    text = (tmp_path / "serve.log").read_text()
    assert "2 replicas ready behind" in text and "1 threads each" in text


def test_replicas_get_the_flags_given_less_the_parents_own(monkeypatch) -> None:
    from octavo.cli import build_parser

    ns = build_parser().parse_args([
        "serve", "--data-parallel-size", "3", "--port", "9000", "--host", "0.0.0.0",
        "--block-size", "32", "--no-enable-prefix-caching", "--api-key-file", "/k",
        "--served-model-name", "a", "b", "--protect-metrics", "--max-num-seqs", "8"])
    flags = replica_flags(ns)
    assert "--port" not in flags and "--host" not in flags
    assert "--data-parallel-size" not in flags
    joined = " ".join(flags)
    for given in ("--block-size 32", "--no-enable-prefix-caching", "--api-key-file /k",
                  "--served-model-name a b", "--protect-metrics", "--max-num-seqs 8"):
        assert given in joined
    assert len(flags) == 11  # nothing left at its default is passed on
    monkeypatch.setenv("OMP_NUM_THREADS", "8")
    assert threads_per_replica(3) == 2 and threads_per_replica(16) == 1


def test_replicas_on_gpus_get_gpus_of_their_own(monkeypatch) -> None:
    """Each replica sees only its own group of GPUs (CUDA_VISIBLE_DEVICES) and computes on
    the first of them; the parent's own visible set and --device cuda:N are respected."""
    from octavo.cli import build_parser
    from octavo.router import data_parallel

    assert replica_gpus("cpu", 2, 1) is None
    assert replica_gpus("cuda", 2, 1, count=4) == ["0", "1"]
    assert replica_gpus("cuda:1", 3, 1, count=4) == ["1", "2", "3"]
    assert replica_gpus("cuda", 2, 2, visible=["3", "5", "6", "7"]) == ["3,5", "6,7"]
    with pytest.raises(ValueError, match="needs 4 GPUs from cuda:1, and this process sees 4"):
        replica_gpus("cuda:1", 2, 2, count=4)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,6")
    assert replica_gpus("cuda", 2, 1) == ["4", "6"]

    started: list[tuple[list[str], dict]] = []

    class Started:
        def poll(self):
            return 0

    def popen(cmd, env, **kwargs):
        started.append((cmd, env))
        return Started()

    monkeypatch.setattr(data_parallel.subprocess, "Popen", popen)
    ns = build_parser().parse_args(["serve", "--data-parallel-size", "2", "--device", "cuda:1",
                                    "--block-size", "32"])
    data_parallel.start_replicas(ns, 2, ["4", "6"])
    assert [env["CUDA_VISIBLE_DEVICES"] for _, env in started] == ["4", "6"]
    for cmd, _ in started:
        assert cmd[cmd.index("--device") + 1] == "cuda" and cmd.count("--device") == 1
        assert "--block-size" in cmd
