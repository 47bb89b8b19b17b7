"""EngineThread runs its calls in order on one daemon thread; `octavo serve` and the test servers
build the model on the thread that then steps it (one OpenMP team per process)."""

from __future__ import annotations

import argparse
import threading

import httpx
import pytest

from octavo.engine.engine_thread import EngineThread


def test_calls_run_in_order_on_one_daemon_thread():
    t = EngineThread(name="t-test")
    seen: list[tuple[int, int]] = []
    futures = [t.submit(lambda i=i: seen.append((i, threading.get_ident())) or i)
               for i in range(20)]
    assert [f.result(timeout=10) for f in futures] == list(range(20))
    assert [i for i, _ in seen] == list(range(20))
    assert {ident for _, ident in seen} == {t.ident}
    assert t.ident != threading.get_ident()
    t.close()


def test_an_exception_reaches_the_caller_and_the_thread_goes_on():
    t = EngineThread()

    def boom():
        raise ValueError("bad prompt")

    with pytest.raises(ValueError, match="bad prompt"):
        t.call(boom)
    assert t.call(lambda: 7) == 7
    t.close()
    with pytest.raises(RuntimeError, match="closed"):
        t.submit(lambda: 1)
    for _ in range(100):
        if not t.is_alive():
            break
        threading.Event().wait(0.01)
    assert not t.is_alive()


def test_serve_builds_the_model_on_the_thread_that_steps_it(monkeypatch):
    import octavo.cli as cli
    import octavo.server.launcher as launcher

    built_on: list[int] = []
    handed: list[EngineThread | None] = []

    def fake_make_llm(args=None):
        built_on.append(threading.get_ident())
        return "llm"

    def fake_run_server(llm, config, host, port, log_level="info", thread=None):
        handed.append(thread)
        return 0

    monkeypatch.setattr(cli, "make_llm", fake_make_llm)
    monkeypatch.setattr(launcher, "run_server", fake_run_server)
    monkeypatch.setattr(launcher, "server_config", lambda args: "config")
    args = argparse.Namespace(host="127.0.0.1", port=0, uvicorn_log_level="warning",
                              data_parallel_size=1)
    assert cli.cmd_serve(args) == 0
    assert handed[0] is not None and built_on == [handed[0].ident]
    assert built_on[0] != threading.get_ident()


def test_the_server_steps_its_engine_on_the_thread_that_built_it(tiny_llama_dir):
    from tests.server.conftest import start_server, stop_server

    s = start_server(tiny_llama_dir, num_kv_blocks=32)
    try:
        engine = s.engine.engine
        stepped_on: set[int] = set()
        step = engine.step

        def recording_step():
            stepped_on.add(threading.get_ident())
            return step()

        engine.step = recording_step
        r = httpx.post(f"{s.url}/v1/completions", json={"prompt": "hi", "max_tokens": 3},
                       timeout=30)
        assert r.status_code == 200, r.text
        assert s.engine._thread is s.engine._given_thread  # the one start_server built on
        assert stepped_on == {s.engine._thread.ident}
    finally:
        stop_server(s)
    assert not s.engine.is_running
