"""Every bad input over raw HTTP: the status and OpenAI's error shape, never a 500."""

from __future__ import annotations

import httpx
import openai
import pytest

from octavo.server.args import DEFAULT_MAX_WAITING_REQUESTS
from octavo.server.launcher import server_config
from tests.server.conftest import API_KEY, RunningServer


def assert_error(r: httpx.Response, status: int, *words: str, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == status and isinstance(err["type"], str) and err["message"]
    for w in words:
        assert w in err["message"], err["message"]
    if param is not None:
        assert err["param"] == param
    return err


@pytest.fixture(scope="module")
def http(tiny_server: RunningServer):
    with httpx.Client(base_url=tiny_server.url, timeout=30) as c:
        yield c


def test_malformed_bodies_are_400(http: httpx.Client) -> None:
    headers = {"content-type": "application/json"}
    assert_error(http.post("/v1/completions", content=b"{bad", headers=headers), 400,
                 "invalid JSON")
    assert_error(http.post("/v1/completions", content=b"[1, 2]", headers=headers), 400)
    assert_error(http.post("/v1/completions", json={}), 400, param="prompt")
    assert_error(http.post("/v1/completions", json={"prompt": 5}), 400)
    assert_error(http.post("/v1/completions", json={"prompt": "x", "temperature": "hot"}), 400,
                 param="temperature")
    assert_error(http.post("/v1/chat/completions", json={"messages": "hi"}), 400)
    assert_error(http.post("/v1/chat/completions", json={"messages": []}), 400,
                 "at least 1 item", param="messages")
    assert_error(http.post("/v1/chat/completions", json={"messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}), 400)


@pytest.mark.parametrize("field,value,word", [
    ("temperature", -1, "temperature"),
    ("top_p", 2.0, "top_p"),
    ("n", 0, "n: Input should be greater than or equal to 1"),
    ("max_tokens", 0, "max_tokens"),
    ("presence_penalty", 3, "presence_penalty"),
    ("min_tokens", 99, "min_tokens"),
    ("logprobs", 100, "logprobs"),
    ("stop", [""], "stop"),
    ("stop_token_ids", [100000], "out of range"),
    ("priority", 3, "priority"),
    ("best_of", 3, "best_of"),
    ("logit_bias", {"1": 500}, "logit_bias"),
    ("logit_bias", {"x1": 5}, "logit_bias"),
    ("logit_bias", {"100000": 5}, "out of range"),
])
def test_invalid_sampling_values_are_400(http: httpx.Client, field, value, word) -> None:
    body = {"prompt": "x", "max_tokens": 4, field: value}
    assert_error(http.post("/v1/completions", json=body), 400, word)
    chat = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 4, field: value}
    if field != "logprobs":
        assert_error(http.post("/v1/chat/completions", json=chat), 400, word)


def test_bad_prompts_are_400(http: httpx.Client) -> None:
    assert_error(http.post("/v1/completions", json={"prompt": ""}), 400, "empty")
    assert_error(http.post("/v1/completions", json={"prompt": []}), 400)
    assert_error(http.post("/v1/completions", json={"prompt": [[1, 2], []]}), 400,
                 "prompt 1 is empty", param="prompt")
    assert_error(http.post("/v1/completions", json={"prompt": ["a", [1]]}), 400, "not a mix")
    assert_error(http.post("/v1/completions", json={"prompt": [3, 999]}), 400, "999")
    assert_error(http.post("/v1/completions", json={"prompt": [-1]}), 400)
    # longer than max_model_len (512): both numbers in the message
    assert_error(http.post("/v1/completions", json={"prompt": [65] * 600}), 400, "600", "512")
    assert_error(http.post("/v1/completions", json={"prompt": "a" * 600, "stream": True}), 400,
                 "600", "512")
    assert_error(http.post("/v1/completions", json={"prompt": [65] * 500, "max_tokens": 50}),
                 400, "512", "550", param="max_tokens")
    assert_error(http.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "a" * 600}]}), 400, "512")
    assert_error(http.post("/detokenize", json={"tokens": [1, 1000]}), 400, "1000")


def test_unknown_model_route_and_method(http: httpx.Client) -> None:
    err = assert_error(http.post("/v1/completions", json={"model": "gpt-9", "prompt": "x"}),
                       404, "gpt-9")
    assert err["param"] == "model"
    assert_error(http.post("/v1/chat/completions", json={
        "model": "gpt-9", "messages": [{"role": "user", "content": "x"}]}), 404)
    assert_error(http.get("/v1/nothing"), 404)
    assert_error(http.get("/v1/completions"), 405)


def test_openai_client_sees_errors(tiny_server: RunningServer) -> None:
    client = openai.OpenAI(base_url=tiny_server.v1, api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model="tiny", prompt="x", temperature=-2)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x")


def test_body_too_large_is_413(limits_server: RunningServer) -> None:
    big = {"prompt": "x" * 2000}
    assert_error(httpx.post(f"{limits_server.url}/v1/completions", json=big), 413, "1024")

    def chunked():
        yield b'{"prompt": "'
        for _ in range(10):
            yield b"y" * 200
        yield b'"}'

    r = httpx.post(f"{limits_server.url}/v1/completions", content=chunked(),
                   headers={"content-type": "application/json"})
    assert_error(r, 413)


def test_overloaded_is_503(limits_server: RunningServer) -> None:
    r = httpx.post(f"{limits_server.url}/v1/completions", json={"prompt": "x"})
    assert_error(r, 503, "waiting")
    r = httpx.post(f"{limits_server.url}/v1/chat/completions",
                   json={"messages": [{"role": "user", "content": "x"}]})
    assert_error(r, 503)
    assert httpx.get(f"{limits_server.url}/v1/models").status_code == 200


def test_api_key(auth_server: RunningServer) -> None:
    url = auth_server.url
    body = {"prompt": "x", "max_tokens": 2}
    assert_error(httpx.post(f"{url}/v1/completions", json=body), 401)
    assert_error(httpx.get(f"{url}/v1/models"), 401)
    assert_error(httpx.post(f"{url}/v1/completions", json=body,
                            headers={"Authorization": "Bearer wrong"}), 401)
    assert_error(httpx.post(f"{url}/v1/completions", json=body,
                            headers={"Authorization": API_KEY}), 401)
    ok = httpx.post(f"{url}/v1/completions", json=body,
                    headers={"Authorization": f"Bearer {API_KEY}"})
    assert ok.status_code == 200
    assert httpx.get(f"{url}/health").status_code == 200
    assert httpx.get(f"{url}/metrics").status_code == 200
    client = openai.OpenAI(base_url=auth_server.v1, api_key=API_KEY, max_retries=0)
    assert client.completions.create(model="tiny", prompt="x", max_tokens=2).usage
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=auth_server.v1, api_key="bad", max_retries=0).models.list()


def test_api_key_off_and_from_env(tiny_server: RunningServer, monkeypatch) -> None:
    assert httpx.get(f"{tiny_server.url}/v1/models").status_code == 200  # no key configured

    import argparse

    from octavo.cli import build_parser

    args = build_parser().parse_args(["serve"])
    assert isinstance(args, argparse.Namespace) and args.api_key is None
    monkeypatch.setenv("OCTAVO_API_KEY", "from-env")
    assert server_config(args).api_key == "from-env"
    monkeypatch.delenv("OCTAVO_API_KEY")
    config = server_config(args)
    assert config.api_key is None and config.served_model_names == []  # the model dir's name
    assert config.max_waiting_requests == DEFAULT_MAX_WAITING_REQUESTS


def test_utility_endpoints(http: httpx.Client) -> None:
    assert http.get("/health").status_code == 200
    assert http.get("/version").json()["version"]
    card = http.get("/v1/models").json()["data"][0]
    assert {"id", "root", "max_model_len", "object", "owned_by"} <= set(card)
    assert card["object"] == "model" and card["max_model_len"] == 512
    tok = http.post("/tokenize", json={"prompt": "hi!"}).json()
    assert tok["tokens"] == [104, 105, 33] and tok["count"] == 3 and tok["max_model_len"] == 512
    chat = http.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert bytes(chat["tokens"]).decode() == "user: hi\nassistant: "
    assert http.post("/detokenize", json={"tokens": [104, 105]}).json() == {"prompt": "hi"}
    assert_error(http.post("/tokenize", json={}), 400)


def test_extreme_but_valid_values_are_not_500(http: httpx.Client) -> None:
    for extra in ({"temperature": 1e30}, {"top_k": 2**63}, {"seed": 2**100},
                  {"top_p": 1e-30}, {"min_p": 1.0}, {"repetition_penalty": 1e30}):
        r = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, **extra})
        assert r.status_code == 200, (extra, r.text)
    headers = {"content-type": "application/json"}
    for raw in (b'{"prompt": "x", "temperature": NaN}', b'{"prompt": "x", "top_p": Infinity}',
                b'{"prompt": "x", "n": 1e400}', b'{"prompt": "x", "max_tokens": 1e20}'):
        r = http.post("/v1/completions", content=raw, headers=headers)
        assert_error(r, 400)
