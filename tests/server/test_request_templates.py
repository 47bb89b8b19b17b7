"""A request's own chat template: refused unless the operator trusts requests with one; with
the opt-in it renders, in jinja2's sandbox and within a time budget, so a template that would
loop for ever is cut off while other requests keep flowing."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from tests.server.conftest import RunningServer, start_server, stop_server

HI = [{"role": "user", "content": "hi"}]
OWN = "{{ 'X' + messages[0]['content'] }}"
FOREVER = ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
           "{{ messages[0]['content'] }}")
BUDGET_S = 0.5


def chat(server: RunningServer, **extra) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/chat/completions", timeout=30,
                      json={"messages": HI, "max_tokens": 2, **extra})


def test_request_templates_are_refused_by_default(tiny_server: RunningServer):
    for extra, param in (({"chat_template": OWN}, "chat_template"),
                         ({"chat_template_kwargs": {"chat_template": OWN}},
                          "chat_template_kwargs")):
        r = chat(tiny_server, **extra)
        assert r.status_code == 400, r.text
        assert "--trust-request-chat-template" in r.json()["error"]["message"]
        assert r.json()["error"]["param"] == param
    for key in ("tokenize", "tokenizer_kwargs", "return_assistant_tokens_mask"):
        r = chat(tiny_server, chat_template_kwargs={key: True})
        assert r.status_code == 400 and key in r.json()["error"]["message"], r.text


@pytest.fixture(scope="module")
def trusting(tiny_llama_dir):
    s = start_server(tiny_llama_dir, num_kv_blocks=64, trust_request_chat_template=True,
                     chat_template_timeout=BUDGET_S)
    yield s
    stop_server(s)


def test_with_the_opt_in_a_request_template_renders(trusting: RunningServer):
    r = chat(trusting, chat_template=OWN)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == len("Xhi")  # byte tokens: its text alone


def test_a_template_that_never_ends_is_cut_off_while_others_flow(trusting: RunningServer,
                                                                  monkeypatch):
    trusting.slow_steps(monkeypatch, 0.01)
    times: list[float] = []
    body = {"prompt": "go", "max_tokens": 300, "ignore_eos": True, "stream": True}

    def read() -> None:
        with httpx.stream("POST", f"{trusting.url}/v1/completions", json=body,
                          timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    times.append(time.monotonic())
                    if len(times) >= 300:
                        return

    stream = threading.Thread(target=read, daemon=True)
    stream.start()
    while len(times) < 3:
        time.sleep(0.01)
    t0 = time.monotonic()
    r = chat(trusting, chat_template=FOREVER)
    took = time.monotonic() - t0
    assert r.status_code == 400, r.text
    assert f"ran longer than {BUDGET_S:g} s" in r.json()["error"]["message"]
    assert took < 10 * BUDGET_S + 5  # cut off, not rendered for ever
    assert sum(t0 <= t <= t0 + took for t in times) > 0  # the stream went on meanwhile
    ok = chat(trusting)  # the tokenizer thread is free again
    assert ok.status_code == 200, ok.text
    stream.join(timeout=60)
