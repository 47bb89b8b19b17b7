"""Request fields that cost work are bounded before they reach the engine thread, and what is
costly is prepared off it (server/request_budget.py): oversized bad_words, stop lists, choices,
grammars, schemas, logit_bias, tools and token-id lists are refused with a 400 naming the
field, a large-but-allowed constraint is compiled on the server's worker thread, and all the
while another stream's tokens keep coming at their idle pace. JSON nested too deep is a 400
with one log line on every POST endpoint."""

from __future__ import annotations

import json
import logging
import threading
import time

import httpx
import pytest

from octavo.server.request_budget import MAX_CONSTRAINT_CHARS
from tests.server.conftest import RunningServer

STEP_S = 0.02  # each engine step sleeps this long: the stream's idle gap, well above noise
BIG = 900_000  # characters: under the test servers' 1 MiB body limit

# (endpoint, body, the field the 400 names)
OVERSIZED = [
    ("/v1/completions", {"bad_words": ["x" * BIG]}, "bad_words"),
    ("/v1/completions", {"bad_words": ["ab"] * 100_000}, "bad_words"),
    ("/v1/completions", {"stop": ["ab"] * 100_000, "n": 16}, "stop"),
    ("/v1/completions", {"stop": ["s" * 500] * 60, "n": 16}, "stop"),  # each allowed, the sum not
    ("/v1/completions", {"guided_choice": [f"c{i}" for i in range(100_000)]}, "guided_choice"),
    ("/v1/completions", {"structured_outputs": {"choice": ["y" * 5000]}}, "structured_outputs"),
    ("/v1/completions", {"guided_regex": "a" * BIG}, "guided_regex"),
    ("/v1/completions", {"guided_grammar": 'start: "' + "g" * BIG + '"'}, "guided_grammar"),
    ("/v1/completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {
            f"p{i}": {"type": "string"} for i in range(30_000)}}}}}, "response_format"),
    ("/v1/completions", {"logit_bias": {str(i % 256): 1 for i in range(301)} | {
        str(1000 + i): 1 for i in range(50_000)}}, "logit_bias"),
    ("/v1/completions", {"allowed_token_ids": [1] * 100_000}, "allowed_token_ids"),
    ("/v1/completions", {"stop_token_ids": [1] * 100_000}, "stop_token_ids"),
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": f"f{i}"}}
                                        for i in range(10_000)]}, "tools"),
]


def body_of(endpoint: str, extra: dict) -> bytes:
    base = ({"prompt": "x", "max_tokens": 4} if endpoint == "/v1/completions" else
            {"messages": [{"role": "user", "content": "x"}], "max_tokens": 4})
    return json.dumps({**base, **extra}).encode()


class Stream:
    """A long completion stream, on a thread, recording when each token arrived (a chunk may
    carry several when the client reads late: counted by their logprobs)."""

    def __init__(self, server: RunningServer) -> None:
        self.times: list[float] = []
        self.stopped = False
        body = {"prompt": "go", "max_tokens": 500, "ignore_eos": True, "stream": True,
                "logprobs": 0}

        def read() -> None:
            with httpx.stream("POST", f"{server.url}/v1/completions", json=body,
                              timeout=120) as r:
                for line in r.iter_lines():
                    if self.stopped:
                        return  # leaving aborts the request
                    if line.startswith("data: {"):
                        tokens = json.loads(line[6:])["choices"][0]["logprobs"]["tokens"]
                        self.times += [time.monotonic()] * len(tokens)

        self.thread = threading.Thread(target=read, daemon=True)
        self.thread.start()

    def mean_gap(self, start: float, end: float) -> float:
        """Seconds per token between `start` and `end` (the whole span if none came)."""
        n = sum(start <= t <= end for t in self.times)
        return (end - start) / max(n, 1)

    def wait_tokens(self, n: int) -> None:
        deadline = time.monotonic() + 30
        while len(self.times) < n and time.monotonic() < deadline:
            time.sleep(0.01)

    def stop(self) -> None:
        self.stopped = True
        self.thread.join(timeout=30)


def test_oversized_fields_are_refused_while_another_stream_keeps_its_pace(
        tiny_server: RunningServer, monkeypatch):
    tiny_server.slow_steps(monkeypatch, STEP_S)
    bodies = [(endpoint, body_of(endpoint, extra), param) for endpoint, extra, param
              in OVERSIZED]
    stream = Stream(tiny_server)
    stream.wait_tokens(5)
    t0 = time.monotonic()
    time.sleep(1.0)
    idle = stream.mean_gap(t0, time.monotonic())
    attack_start = time.monotonic()
    with httpx.Client(base_url=tiny_server.url, timeout=60,
                      headers={"Content-Type": "application/json"}) as client:
        for endpoint, body, param in bodies:
            r = client.post(endpoint, content=body)
            assert r.status_code == 400, (param, r.text[:300])
            assert r.json()["error"]["param"] == param, (param, r.text[:300])
        # allowed, yet costly: 1,000 choices are compiled on the worker thread
        choices = [f"choice {i}" for i in range(1000)]
        r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 12,
                                                 "guided_choice": choices})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] in choices, r.text
    attack_end = time.monotonic()
    time.sleep(0.1)  # tokens of the window still on their way
    stream.stop()
    busy = stream.mean_gap(attack_start, attack_end)
    print(f"idle {idle * 1e3:.1f} ms/token, during {busy * 1e3:.1f} ms/token over "
          f"{attack_end - attack_start:.2f} s")
    assert busy <= 2 * idle, (busy, idle)
    assert tiny_server.wait_idle()["octavo:kv_blocks_used"] == 0


def test_a_constraint_too_large_for_the_compiler_is_a_clean_400(tiny_server: RunningServer):
    """llguidance's own errors reach the client as one line, never a Rust backtrace."""
    r = httpx.post(f"{tiny_server.url}/v1/completions", json={
        "prompt": "x", "max_tokens": 2, "guided_regex": "(a" * 20 + ")" * 19})
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert "backtrace" not in message and "\n" not in message and len(message) < 600
    assert r.json()["error"]["param"] == "guided_regex"
    big = "a" * (MAX_CONSTRAINT_CHARS + 1)
    r = httpx.post(f"{tiny_server.url}/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "x"}], "max_tokens": 2,
        "structured_outputs": {"regex": big}})
    assert r.status_code == 400 and "characters" in r.json()["error"]["message"], r.text


POST_ENDPOINTS = ["/v1/completions", "/v1/chat/completions", "/v1/messages",
                  "/v1/messages/count_tokens", "/v1/responses", "/tokenize", "/detokenize"]


@pytest.mark.parametrize("depth", [100, 600])
def test_deep_json_is_a_400_with_one_log_line_on_every_post_endpoint(
        tiny_server: RunningServer, caplog, depth):
    nested = "[" * depth + "]" * depth
    with caplog.at_level(logging.INFO):
        for path in POST_ENDPOINTS:
            r = httpx.post(f"{tiny_server.url}{path}", headers={
                "Content-Type": "application/json"},
                content=f'{{"model": "tiny", "prompt": {nested}, "x": "[[["}}'.encode())
            assert r.status_code == 400, (path, r.status_code, r.text[:200])
            assert "nested" in r.text, (path, r.text[:200])
    records = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(records) <= 1 and all(r.exc_info is None for r in records), \
        [r.getMessage() for r in records]
    assert not any("unhandled" in r.getMessage() for r in caplog.records)
