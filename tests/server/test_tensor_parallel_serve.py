"""`octavo serve --tensor-parallel-size 2`: a worker killed mid-generation fails the stream in
flight with an error naming it, /health turns 503, new requests get 503, and SIGTERM still
stops the server (exit 0) and its workers."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import httpx

from tests.server.test_lifecycle import start_serve_process


def stream_into(url: str, body: dict, into: list[str]) -> None:
    """Append each line of a streamed completion as it arrives."""
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True},
                      timeout=60) as r:
        for line in r.iter_lines():
            into.append(line)


def _workers(pid: int) -> dict[int, int]:
    """rank -> pid of the server's mp workers (children running mp_worker RANK SIZE)."""
    found: dict[int, int] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            cmd = Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")
            if b"octavo.engine.executor.mp_worker" in cmd:
                found[int(cmd[cmd.index(b"octavo.engine.executor.mp_worker") + 1])] = int(child)
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split()[2]
    except FileNotFoundError:
        return False
    return state != "Z"


def test_a_killed_worker_fails_the_stream_and_health_then_sigterm_exits(tiny_llama_dir):
    proc, url = start_serve_process(tiny_llama_dir, "--tensor-parallel-size", "2")
    try:
        ok = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 4},
                        timeout=60)
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4
        workers = _workers(proc.pid)
        assert sorted(workers) == [0, 1]
        lines: list[str] = []
        body = {"prompt": "story", "max_tokens": 480, "ignore_eos": True}
        t = threading.Thread(target=stream_into, args=(url, body, lines))
        t.start()
        deadline = time.monotonic() + 30
        while not any(x.startswith("data: ") for x in lines) and time.monotonic() < deadline:
            time.sleep(0.02)
        killed = workers[1]
        os.kill(killed, signal.SIGKILL)
        t.join(timeout=60)
        assert not t.is_alive(), "the stream ended"
        data = [x for x in lines if x.startswith("data: ")]
        assert data[-1] == "data: [DONE]"
        error = json.loads(data[-2][6:])["error"]["message"]
        # the stream gets the generic failure naming its request; /health says what happened
        assert "the model step failed (request cmpl-" in error and "pid" not in error
        health = httpx.get(f"{url}/health", timeout=5)
        assert health.status_code == 503
        assert "rank 1" in health.json()["error"]["message"]
        refused = httpx.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 1},
                             timeout=5)
        assert refused.status_code == 503 and "rank 1" in refused.json()["error"]["message"]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        assert not any(_alive(p) for p in workers.values())
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
