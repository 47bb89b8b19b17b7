"""Failures stay contained: a failed model step fails only the requests of that step, and an
engine thread that dies makes /health fail and the server exit with status 1."""

from __future__ import annotations

import json
import logging
import re
import threading
import time

import httpx
import pytest

from tests.server.conftest import start_server, stop_server


def test_a_failed_step_fails_only_its_requests(tiny_llama_dir, caplog):
    s = start_server(tiny_llama_dir, num_kv_blocks=64, max_num_seqs=1)  # one request at a time
    try:
        runner = s.engine.engine.runner
        real = runner.execute
        calls = {"n": 0}

        def flaky(plan):
            calls["n"] += 1
            if calls["n"] == 5:  # a decode step of the first request
                raise RuntimeError("injected device error")
            return real(plan)

        runner.execute = flaky
        first: list[str] = []
        body = {"prompt": "first", "max_tokens": 50, "ignore_eos": True, "stream": True}

        def stream():
            with httpx.stream("POST", f"{s.url}/v1/completions", json=body, timeout=60) as r:
                first.extend(r.iter_lines())

        t = threading.Thread(target=stream)
        t.start()
        while not first:
            time.sleep(0.01)
        # this one waits (max_num_seqs=1), outside the step that fails
        second = httpx.post(f"{s.url}/v1/completions", json={
            "prompt": "second", "max_tokens": 8, "ignore_eos": True}, timeout=60)
        t.join(timeout=30)
        events = [json.loads(x[6:]) for x in first if x.startswith("data: {")]
        # the client gets a generic message naming its request; the log has the cause
        message = events[-1]["error"]["message"]
        named = re.fullmatch(r"the model step failed \(request (cmpl-\w+)\); the server log "
                             r"has the details", message)
        assert named, message
        request_id = named.group(1)
        assert all(e.get("id", request_id) == request_id for e in events)
        logged = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
        assert any("injected device error" in m and request_id in m for m in logged), logged
        assert second.status_code == 200, second.text
        assert second.json()["choices"][0]["finish_reason"] == "length"
        assert httpx.get(f"{s.url}/health").status_code == 200
        assert s.wait_idle()["octavo:kv_blocks_used"] == 0
    finally:
        stop_server(s)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_dead_engine_fails_health_and_the_server_exits_1(tiny_llama_dir):
    s = start_server(tiny_llama_dir, num_kv_blocks=32)
    async_engine = s.engine

    def broken():
        raise RuntimeError("injected bug in the engine loop")

    async_engine._publish_stats = broken  # runs on the engine thread, outside any step
    httpx.post(f"{s.url}/v1/completions", json={"prompt": "x", "max_tokens": 1}, timeout=30)
    s.thread.join(timeout=30)
    assert not s.thread.is_alive(), "the server stopped by itself"
    assert s.server.exit_code == 1
    assert not async_engine.is_running
