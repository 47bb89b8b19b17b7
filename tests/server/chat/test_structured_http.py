"""Structured outputs over HTTP, with the official `openai` client against a real server.

The embedded SmolLM2 samples at temperature 1 under every benchmark schema (many requests at
once, so the server batches constrained and unconstrained rows together); every choice must
parse and validate. Then the other spellings of a constraint (vLLM's `structured_outputs` and
`guided_*` fields, on /v1/completions too), streaming, logprobs, the 400s a bad constraint
gets, and a constraint cut short by max_tokens.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jsonschema
import openai
import pytest

from octavo.bench.json_schemas import SCHEMAS
from tests.server.conftest import RunningServer, start_server, stop_server

MODEL = "smollm2"
SMALL = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0,
                                                "maximum": 99}},
         "required": ["a"], "additionalProperties": False}
PROMPTS = {
    "person": "Invent a person and describe them as JSON.",
    "order": "Write a shop order as JSON.",
    "weather": "Report today's weather in some city as JSON.",
    "tags": "Give a blog post title and its tags as JSON.",
    "nested": "Describe a company as JSON.",
    "matrix": "Write a small matrix of numbers as JSON.",
}


@pytest.fixture(scope="module")
def server(default_model_dir) -> Iterator[RunningServer]:
    s = start_server(default_model_dir, name=MODEL, num_kv_blocks=512, max_model_len=2048,
                     enable_auto_tool_choice=True, tool_call_parser="hermes")
    yield s
    stop_server(s)


@pytest.fixture(scope="module")
def client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0, timeout=120)


def json_schema_format(name: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema}}


def user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def assert_serves(client: openai.OpenAI) -> None:
    r = client.completions.create(model=MODEL, prompt="1, 2, 3,", max_tokens=3, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length")


# ---- every schema, many seeds, batched ------------------------------------------------------
def test_json_schema_sweep_validates(client: openai.OpenAI) -> None:
    """Every choice parses and validates. A number's digits are unbounded in JSON (and so in
    its grammar): at temperature 1 the model may run "10.000000..." out to max_tokens; such a
    choice (a digit run up to the cut) is the one "length" allowed, and must stay rare."""
    jobs = []  # (schema name, seed, n)
    for name in SCHEMAS:
        jobs += [(name, seed, 1) for seed in range(6)]
        jobs.append((name, 100, 4))

    def run(job: tuple[str, int, int]):
        name, seed, n = job
        return job, client.chat.completions.create(
            model=MODEL, messages=user(PROMPTS[name]),
            response_format=json_schema_format(name, SCHEMAS[name]),
            temperature=1.0, seed=seed, n=n, max_tokens=256,
        )

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(run, jobs))
    assert len(results) == 42
    choices = cut = 0
    for (name, seed, n), r in results:
        assert len(r.choices) == n and [c.index for c in r.choices] == list(range(n))
        for c in r.choices:
            choices += 1
            where = f"{name} seed={seed} choice={c.index}: {c.message.content!r}"
            assert not c.message.tool_calls, where
            if c.finish_reason == "length" and re.search(r"[0-9]{40}$", c.message.content):
                cut += 1
                continue
            assert c.finish_reason == "stop", where
            jsonschema.validate(json.loads(c.message.content), SCHEMAS[name])
        assert r.usage.completion_tokens > 0
    assert choices == 60 and cut <= 3


def test_json_object(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=MODEL, messages=user("Describe a cat as a JSON object."),
        response_format={"type": "json_object"}, temperature=0, max_tokens=150)
    c = r.choices[0]
    assert c.finish_reason == "stop"
    assert isinstance(json.loads(c.message.content), dict)


# ---- /v1/completions and the other spellings ------------------------------------------------
def complete(client: openai.OpenAI, prompt: str, extra: dict[str, Any], **kw: Any):
    kw = {"max_tokens": 60, "temperature": 0, **kw}
    return client.completions.create(model=MODEL, prompt=prompt, extra_body=extra, **kw)


def test_completions_response_format(client: openai.OpenAI) -> None:
    r = complete(client, "A person as JSON:",
                 {"response_format": json_schema_format("person", SCHEMAS["person"])},
                 max_tokens=120, temperature=1.0, seed=5, n=2)
    for c in r.choices:
        assert c.finish_reason == "stop", c.text
        jsonschema.validate(json.loads(c.text), SCHEMAS["person"])
    r = complete(client, "An object:", {"response_format": {"type": "json_object"}},
                 max_tokens=120)
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].text), dict)


REGEX = r"[0-9]{3}-[0-9]{4}"
CHOICES = ["yes", "no", "maybe"]
LARK = 'start: greeting " " name\ngreeting: "hello" | "hi"\nname: /[A-Z][a-z]{1,8}/'
LARK_RE = r"(hello|hi) [A-Z][a-z]{1,8}"


@pytest.mark.parametrize("spelling", ["structured_outputs", "guided"])
def test_completions_constraint_spellings(client: openai.OpenAI, spelling: str) -> None:
    def field(kind: str, value: Any) -> dict[str, Any]:
        if spelling == "guided":
            return {f"guided_{kind}": value}
        return {"structured_outputs": {kind: value}}

    def regex(text: str) -> bool:
        return re.fullmatch(REGEX, text) is not None

    def choice(text: str) -> bool:
        return text in CHOICES

    def grammar(text: str) -> bool:
        return re.fullmatch(LARK_RE, text) is not None

    def weather(text: str) -> bool:
        jsonschema.validate(json.loads(text), SCHEMAS["weather"])
        return True

    cases = [("Phone number:", "regex", REGEX, regex), ("Is the sky blue?", "choice", CHOICES,
                                                        choice),
             ("Greet someone:", "grammar", LARK, grammar),
             ("Weather as JSON:", "json", SCHEMAS["weather"], weather)]
    jobs = [(case, seed) for case in cases for seed in (1, 2, 3)]

    def run(job):
        (prompt, kind, value, _), seed = job
        return complete(client, prompt, field(kind, value), temperature=1.0, seed=seed,
                        max_tokens=120)

    with ThreadPoolExecutor(12) as pool:
        results = list(pool.map(run, jobs))
    for ((_, kind, _, check), seed), r in zip(jobs, results, strict=True):
        text = r.choices[0].text
        assert r.choices[0].finish_reason == "stop", (kind, seed, text)
        assert check(text), (kind, seed, text)


def test_chat_structured_outputs_field(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=MODEL, messages=user("Is water wet?"), temperature=1.0, seed=3, max_tokens=10,
        n=3, extra_body={"structured_outputs": {"choice": CHOICES}})
    assert all(c.message.content in CHOICES and c.finish_reason == "stop" for c in r.choices)
    r = client.chat.completions.create(
        model=MODEL, messages=user("A number:"), temperature=0, max_tokens=60,
        extra_body={"guided_json": json.dumps(SMALL)})  # a schema given as its JSON text
    jsonschema.validate(json.loads(r.choices[0].message.content), SMALL)


# ---- streaming and logprobs -----------------------------------------------------------------
def test_streamed_json_schema_validates(client: openai.OpenAI) -> None:
    name = "order"
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=user(PROMPTS[name]),
        response_format=json_schema_format(name, SCHEMAS[name]),
        temperature=1.0, seed=11, n=2, max_tokens=256, stream=True,
        stream_options={"include_usage": True}))
    text: dict[int, str] = {0: "", 1: ""}
    finish: dict[int, str] = {}
    for ch in chunks:
        for c in ch.choices:
            text[c.index] += c.delta.content or ""
            assert not c.delta.tool_calls
            if c.finish_reason is not None:
                assert c.index not in finish
                finish[c.index] = c.finish_reason
    assert finish == {0: "stop", 1: "stop"}
    for i in (0, 1):
        jsonschema.validate(json.loads(text[i]), SCHEMAS[name])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0


def test_stream_matches_whole_response(client: openai.OpenAI) -> None:
    kwargs = dict(model=MODEL, messages=user(PROMPTS["weather"]), temperature=0, max_tokens=120,
                  response_format=json_schema_format("weather", SCHEMAS["weather"]))
    whole = client.chat.completions.create(**kwargs).choices[0].message.content
    streamed = "".join(c.choices[0].delta.content or ""
                       for c in client.chat.completions.create(**kwargs, stream=True)
                       if c.choices)
    assert streamed == whole
    jsonschema.validate(json.loads(whole), SCHEMAS["weather"])


def test_logprobs_with_a_constraint(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=MODEL, messages=user("Pick a number as JSON."),
        response_format=json_schema_format("small", SMALL), temperature=1.0, seed=2,
        max_tokens=40, logprobs=True, top_logprobs=2)
    c = r.choices[0]
    assert c.finish_reason == "stop"
    jsonschema.validate(json.loads(c.message.content), SMALL)
    content = c.logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert all(t.logprob <= 0 and len(t.top_logprobs) == 2 for t in content)
    assert all(t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob for t in content)
    # the tokens spell the content, then the EOS token that ended it (listed, as in vLLM)
    assert b"".join(bytes(t.bytes) for t in content[:-1]).decode() == c.message.content
    assert content[-1].token == "<|im_end|>"
    streamed = list(client.chat.completions.create(
        model=MODEL, messages=user("Pick a number as JSON."),
        response_format=json_schema_format("small", SMALL), temperature=1.0, seed=2,
        max_tokens=40, logprobs=True, top_logprobs=2, stream=True))
    lp = [t for ch in streamed if ch.choices and ch.choices[0].logprobs
          for t in ch.choices[0].logprobs.content or []]
    assert [t.token for t in lp] == [t.token for t in content]


# ---- bad constraints: 400 in OpenAI's shape -------------------------------------------------
BAD_CHAT = [
    ("uncompilable schema",
     {"response_format": json_schema_format("bad", {"type": "no-such-type"})},
     "no-such-type", "response_format"),
    ("invalid regex", {"extra_body": {"structured_outputs": {"regex": "(["}}},
     "regex", "structured_outputs"),
    ("invalid lark", {"extra_body": {"structured_outputs": {"grammar": "start: ("}}},
     "grammar", "structured_outputs"),
    ("two constraints", {"response_format": {"type": "json_object"},
                         "extra_body": {"structured_outputs": {"regex": "a+"}}},
     "not several", "structured_outputs"),
    ("no constraint field", {"extra_body": {"structured_outputs": {}}},
     "exactly one of json, regex, choice, grammar or json_object", "structured_outputs"),
    ("empty choice", {"extra_body": {"structured_outputs": {"choice": []}}},
     "choice must be a non-empty list", "structured_outputs"),
    ("guided regex invalid", {"extra_body": {"guided_regex": "(["}}, "regex", "guided_regex"),
    ("json_schema without a schema",
     {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "json_schema.schema", "response_format"),
]


def bad_request(call) -> dict[str, Any]:
    with pytest.raises(openai.BadRequestError) as info:
        call()
    e = info.value
    assert e.status_code == 400
    assert isinstance(e.body, dict) and set(e.body) >= {"message", "type", "param"}
    assert e.body["type"] == "BadRequestError" and e.body["message"]
    return e.body


@pytest.mark.parametrize("label,kwargs,says,param", BAD_CHAT, ids=[b[0] for b in BAD_CHAT])
def test_bad_constraint_is_400(client: openai.OpenAI, label: str, kwargs: dict, says: str,
                               param: str) -> None:
    body = bad_request(lambda: client.chat.completions.create(
        model=MODEL, messages=user("hi"), max_tokens=5, **kwargs))
    assert says in body["message"], body
    assert_serves(client)


BAD_COMPLETIONS = [
    ("invalid regex", {"structured_outputs": {"regex": "(["}}, "regex"),
    ("invalid lark", {"structured_outputs": {"grammar": "start: ("}}, "grammar"),
    ("uncompilable schema", {"structured_outputs": {"json": {"type": "no-such-type"}}},
     "no-such-type"),
    ("empty choice", {"guided_choice": []}, "choice must be a non-empty list"),
    ("two constraints", {"guided_regex": "a+", "structured_outputs": {"choice": ["a"]}},
     "not several"),
]


@pytest.mark.parametrize("label,extra,says", BAD_COMPLETIONS,
                         ids=[b[0] for b in BAD_COMPLETIONS])
def test_bad_completions_constraint_is_400(client: openai.OpenAI, label: str, extra: dict,
                                           says: str) -> None:
    body = bad_request(lambda: complete(client, "hi", extra, max_tokens=5))
    assert says in body["message"], body
    assert_serves(client)


@pytest.mark.parametrize("extra,param", [
    ({"structured_outputs": {"regex": "(["}}, "structured_outputs"),
    ({"guided_grammar": "start: ("}, "guided_grammar"),
    ({"structured_outputs": {"json": {"type": "no-such-type"}}}, "structured_outputs"),
], ids=["structured_outputs regex", "guided_grammar", "structured_outputs json"])
def test_uncompilable_constraint_names_its_field(client: openai.OpenAI, extra: dict,
                                                 param: str) -> None:
    """The error's param is the field the client sent, not always "response_format"."""
    body = bad_request(lambda: complete(client, "hi", extra, max_tokens=5))
    assert body["param"] == param, body


# ---- cut short ------------------------------------------------------------------------------
def test_max_tokens_too_small_is_length(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=MODEL, messages=user(PROMPTS["order"]), temperature=0, max_tokens=6,
        response_format=json_schema_format("order", SCHEMAS["order"]))
    c = r.choices[0]
    assert c.finish_reason == "length" and r.usage.completion_tokens == 6
    assert c.message.content.startswith("{")
    with pytest.raises(json.JSONDecodeError):
        json.loads(c.message.content)
    r = complete(client, "Order:", {"structured_outputs": {"json": SCHEMAS["order"]}},
                 max_tokens=6, stream=True)
    chunks = [c for c in r if c.choices]
    assert chunks[-1].choices[0].finish_reason == "length"


def test_all_kv_blocks_back(server: RunningServer, client: openai.OpenAI) -> None:
    assert_serves(client)
    m = server.wait_idle()
    assert m["octavo:kv_blocks_used"] == 0
    assert m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0
