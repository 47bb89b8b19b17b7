"""The holes found by attacking the server, each kept closed: strict types and finite numbers,
text that must be valid Unicode, bounded requests, huge prompts refused without tokenizing and
tokenizing kept off the event loop, and the auth details."""

from __future__ import annotations

import threading

import httpx
import pytest

from octavo.server.middleware import bearer_token
from tests.server.conftest import API_KEY, RunningServer
from tests.server.test_errors import assert_error

RAW = {"content-type": "application/json"}


@pytest.fixture(scope="module")
def http(tiny_server: RunningServer):
    with httpx.Client(base_url=tiny_server.url, timeout=30) as c:
        yield c


@pytest.mark.parametrize("body", [
    b'{"prompt": "a\\ud800b", "max_tokens": 1}',
    b'{"prompt": ["ok", "a\\udfffb"], "max_tokens": 1}',
    b'{"prompt": "x", "stop": ["\\ud800"], "max_tokens": 1}',
])
def test_lone_surrogates_are_a_400_naming_the_field(http, body):
    err = assert_error(http.post("/v1/completions", content=body, headers=RAW), 400,
                       "not valid Unicode")
    assert err["param"].split(".")[0] in ("prompt", "stop")


def test_lone_surrogates_in_chat_and_tokenize(http):
    chat = b'{"messages": [{"role": "user", "content": "hi \\ud800"}], "max_tokens": 1}'
    assert_error(http.post("/v1/chat/completions", content=chat, headers=RAW), 400,
                 "not valid Unicode", param="messages.0.content")
    assert_error(http.post("/tokenize", content=b'{"prompt": "a\\ud800b"}', headers=RAW), 400,
                 "not valid Unicode", param="prompt")


@pytest.mark.parametrize("field", ["temperature", "repetition_penalty", "top_p",
                                   "presence_penalty", "min_p"])
@pytest.mark.parametrize("value", [b"Infinity", b"-Infinity", b"NaN", b"1e999", b'"inf"',
                                   b'"0.5"'])
def test_numbers_must_be_finite_json_numbers(http, field, value):
    body = b'{"prompt": "x", "max_tokens": 1, "%s": %s}' % (field.encode(), value)
    assert_error(http.post("/v1/completions", content=body, headers=RAW), 400, param=field)


@pytest.mark.parametrize(("extra", "param"), [
    ({"stream": "yes"}, "stream"),
    ({"stream": 1}, "stream"),
    ({"echo": "true"}, "echo"),
    ({"n": 2.5}, "n"),
    ({"n": True}, "n"),
    ({"max_tokens": "4"}, "max_tokens"),
    ({"seed": 1.5}, "seed"),
    ({"stop_token_ids": [1.5]}, "stop_token_ids.0"),
    ({"stop_token_ids": ["1"]}, "stop_token_ids.0"),
])
def test_types_are_strict(http, extra, param):
    r = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1, **extra})
    assert_error(r, 400)
    assert r.json()["error"]["param"].startswith(param)


def test_token_ids_must_be_integers(http):
    assert_error(http.post("/v1/completions", json={"prompt": [1.5, 2], "max_tokens": 1}),
                 400, param="prompt")
    assert_error(http.post("/v1/completions", json={"prompt": [[3, 4], [5.5]], "max_tokens": 1}),
                 400, param="prompt")
    assert_error(http.post("/v1/completions", json={"prompt": [True, 2], "max_tokens": 1}),
                 400, param="prompt")
    assert_error(http.post("/detokenize", json={"tokens": [104.5]}), 400)


def test_integers_are_json_schema_integers(http):
    """JSON Schema counts 2.0 as the integer 2 (so do OpenAI's schemas); it is read as 2."""
    r = http.post("/v1/completions", json={"prompt": [65.0, 66.0], "max_tokens": 3.0,
                                           "n": 2.0, "ignore_eos": True, "temperature": 0})
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 2
    assert r.json()["usage"]["completion_tokens"] == 6
    assert http.post("/detokenize", json={"tokens": [104.0, 105]}).json() == {"prompt": "hi"}


def test_chat_roles_are_the_known_ones(http):
    for role in ("admin", "", "USER"):
        r = http.post("/v1/chat/completions", json={
            "messages": [{"role": role, "content": "hi"}], "max_tokens": 1})
        assert_error(r, 400, param="messages.0.role")
    ok = http.post("/v1/chat/completions", json={
        "messages": [{"role": "system", "content": "be brief"},
                     {"role": "user", "content": "hi"}], "max_tokens": 1})
    assert ok.status_code == 200, ok.text


def test_the_offline_api_rejects_non_finite_values_too():
    from octavo.sampling_params import BeamSearchParams, SamplingParams

    for name in ("temperature", "repetition_penalty", "top_p", "presence_penalty", "min_p"):
        for bad in (float("inf"), float("nan")):
            with pytest.raises(ValueError, match=f"{name} must be a finite number"):
                SamplingParams(**{name: bad})
    with pytest.raises(ValueError, match="length_penalty must be a finite number"):
        BeamSearchParams(beam_width=2, max_tokens=4, length_penalty=float("inf"))


def test_prompts_per_request_and_prompts_times_n_are_bounded(http, tiny_server):
    limits = tiny_server.engine  # the defaults: 128 prompts, 1024 sequences
    assert limits is not None
    before = tiny_server.metrics()["vllm:prompt_tokens_total"]
    assert_error(http.post("/v1/completions", json={"prompt": ["x"] * 129, "max_tokens": 1}),
                 400, "129 prompts", "at most 128", param="prompt")
    assert_error(http.post("/v1/completions", json={"prompt": [[5]] * 100, "n": 11,
                                                    "max_tokens": 1}),
                 400, "1100 sequences", param="n")
    assert_error(http.post("/v1/completions", json={"prompt": [], "max_tokens": 1}), 400)
    # nothing of the refused requests reached the engine
    assert tiny_server.metrics()["vllm:prompt_tokens_total"] == before
    ok = http.post("/v1/completions", json={"prompt": ["a", "b", "c"], "n": 2, "max_tokens": 2})
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 6


def test_a_prompt_too_long_to_fit_is_refused_without_tokenizing(http, tiny_server, monkeypatch):
    """The tiny model's byte tokens are one character each: 512 tokens hold 512 characters."""
    ctx = tiny_server.server.config.app.state.ctx
    calls = []
    real = ctx.tokenizer.encode
    monkeypatch.setattr(ctx.tokenizer, "encode",
                        lambda *a, **k: calls.append(threading.current_thread().name)
                        or real(*a, **k))
    huge = "x" * 900_000  # under the 1 MiB body limit of the test server
    assert_error(http.post("/v1/completions", json={"prompt": huge, "max_tokens": 1}), 400,
                 "900000 characters", param="prompt")
    assert_error(http.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": huge}], "max_tokens": 1}), 400,
        "characters", param="messages")
    assert_error(http.post("/tokenize", json={"prompt": huge}), 400, "characters")
    assert calls == []
    # one that may fit is tokenized, off the event loop, in the tokenizer thread
    r = http.post("/v1/completions", json={"prompt": "y" * 300, "max_tokens": 1})
    assert r.status_code == 200, r.text
    assert calls and all(name.startswith("octavo-tokenize") for name in calls)


def test_bearer_scheme_is_case_insensitive(auth_server: RunningServer):
    for header in (f"Bearer {API_KEY}", f"bearer {API_KEY}", f"BEARER  {API_KEY}"):
        r = httpx.get(f"{auth_server.url}/v1/models", headers={"Authorization": header})
        assert r.status_code == 200, header
    for header in (f"Basic {API_KEY}", API_KEY, "Bearer", f"Bearer {API_KEY}x"):
        r = httpx.get(f"{auth_server.url}/v1/models", headers={"Authorization": header})
        assert_error(r, 401)
    assert bearer_token(b"  bEaReR tok ") == b"tok" and bearer_token(b"Token tok") == b""


def test_api_key_file_and_protected_metrics(tmp_path, tiny_llama_dir):
    from octavo.cli import build_parser
    from octavo.server.launcher import server_config
    from tests.server.conftest import start_server, stop_server

    key_file = tmp_path / "key"
    key_file.write_text("file-key-456\n")
    args = build_parser().parse_args(["serve", "--api-key-file", str(key_file),
                                      "--protect-metrics"])
    config = server_config(args)
    assert config.api_key == "file-key-456" and config.protect_metrics
    with pytest.raises(ValueError, match="--api-key-file: .* holds no key"):
        (tmp_path / "empty").write_text("\n")
        server_config(build_parser().parse_args(["serve", "--api-key-file",
                                                 str(tmp_path / "empty")]))
    with pytest.raises(ValueError, match="--protect-metrics needs an API key"):
        server_config(build_parser().parse_args(["serve", "--protect-metrics"]))
    s = start_server(tiny_llama_dir, api_key="file-key-456", protect_metrics=True,
                     num_kv_blocks=32)
    try:
        assert httpx.get(f"{s.url}/health").status_code == 200
        assert_error(httpx.get(f"{s.url}/metrics"), 401)
        ok = httpx.get(f"{s.url}/metrics", headers={"Authorization": "Bearer file-key-456"})
        assert ok.status_code == 200 and "octavo:" in ok.text
    finally:
        stop_server(s)


def test_logit_bias_steers_sampling(http):
    """OpenAI's logit_bias: +100 all but forces a token, -100 bans one."""
    forced = http.post("/v1/completions", json={
        "prompt": "x", "max_tokens": 6, "temperature": 0, "logit_bias": {"65": 100}})
    assert forced.status_code == 200, forced.text
    assert forced.json()["choices"][0]["text"] == "AAAAAA"
    free = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 6, "temperature": 0,
                                              "ignore_eos": True})
    top = free.json()["choices"][0]["text"][0]
    banned = http.post("/v1/completions", json={
        "prompt": "x", "max_tokens": 6, "temperature": 0, "ignore_eos": True,
        "logit_bias": {str(ord(top)): -100}})
    assert top not in banned.json()["choices"][0]["text"]
