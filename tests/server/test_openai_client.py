"""The official `openai` client against a running server: the compatibility that matters."""

from __future__ import annotations

import openai
import pytest

from tests.server.conftest import RunningServer


@pytest.fixture(scope="module")
def client(tiny_server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=tiny_server.v1, api_key="unused", max_retries=0)


def test_models(client: openai.OpenAI) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == ["tiny"]
    assert models[0].model_extra["root"] and models[0].model_extra["max_model_len"] == 512


def test_completion_exact_length_and_usage(client: openai.OpenAI) -> None:
    r = client.completions.create(model="tiny", prompt="Hello", max_tokens=12, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.object == "text_completion" and len(r.choices) == 1
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == 5 and r.usage.completion_tokens == 12
    assert r.usage.total_tokens == 17


def test_completion_prompt_forms_and_n(client: openai.OpenAI) -> None:
    r = client.completions.create(model="tiny", prompt=["ab", "cd"], max_tokens=4, n=2,
                                  temperature=1.0, seed=3, extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.usage.prompt_tokens == 4 and r.usage.completion_tokens == 16
    # token ids (the byte tokenizer: id = byte) give the same greedy text as the string
    by_text = client.completions.create(model="tiny", prompt="hey", max_tokens=6, temperature=0)
    by_ids = client.completions.create(model="tiny", prompt=[104, 101, 121], max_tokens=6,
                                       temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    batch = client.completions.create(model="tiny", prompt=[[104, 101, 121], [1, 2, 3]],
                                      max_tokens=6, temperature=0)
    assert batch.choices[0].text == by_text.choices[0].text and len(batch.choices) == 2


def test_stream_matches_non_stream_and_reports_usage(client: openai.OpenAI) -> None:
    kwargs = dict(model="tiny", prompt="Once upon", max_tokens=20, temperature=0,
                  extra_body={"ignore_eos": True})
    full = client.completions.create(**kwargs)
    chunks = list(client.completions.create(**kwargs, stream=True,
                                            stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    assert all(c.usage is None for c in chunks[:-1])


def test_completion_logprobs_and_echo(client: openai.OpenAI) -> None:
    r = client.completions.create(model="tiny", prompt="abc", max_tokens=5, temperature=0,
                                  logprobs=2, extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert all(x <= 0 for x in lp.token_logprobs)
    assert all(1 <= len(top) <= 3 for top in lp.top_logprobs)
    assert lp.text_offset == sorted(lp.text_offset)
    e = client.completions.create(model="tiny", prompt="abc", max_tokens=5, temperature=0,
                                  logprobs=1, echo=True, extra_body={"ignore_eos": True})
    assert e.choices[0].text == "abc" + r.choices[0].text
    elp = e.choices[0].logprobs
    assert len(elp.tokens) == 8 and elp.token_logprobs[0] is None
    assert elp.token_logprobs[3:] == pytest.approx(lp.token_logprobs, abs=1e-4)


def test_stop_string(client: openai.OpenAI) -> None:
    base = client.completions.create(model="tiny", prompt="stop here", max_tokens=32,
                                     temperature=0, extra_body={"ignore_eos": True})
    text = base.choices[0].text
    stop = next(ch for ch in text[3:] if ch.isascii() and ch.isalnum())
    r = client.completions.create(model="tiny", prompt="stop here", max_tokens=32,
                                  temperature=0, stop=[stop], extra_body={"ignore_eos": True})
    assert r.choices[0].text == text[: text.index(stop)]
    assert r.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model="tiny", prompt="stop here", max_tokens=32,
                                         temperature=0, stop=[stop], stream=True,
                                         extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in streamed if c.choices) == r.choices[0].text


def test_seed_reproducible(client: openai.OpenAI) -> None:
    def sample(seed: int) -> str:
        return client.completions.create(
            model="tiny", prompt="seeded", max_tokens=16, temperature=1.0, seed=seed,
            extra_body={"ignore_eos": True},
        ).choices[0].text

    assert sample(7) == sample(7)
    assert sample(7) != sample(8)


def test_chat_stream_role_then_content(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "hi"}]
    full = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10,
                                          temperature=0, extra_body={"ignore_eos": True})
    assert full.choices[0].message.role == "assistant"
    assert full.usage.completion_tokens == 10
    chunks = list(client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=10, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    ))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == (
        full.choices[0].message.content)
    assert chunks[-1].usage.completion_tokens == 10


def test_chat_n_and_logprobs(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=6, n=2,
        temperature=1.0, seed=1, logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True},
    )
    assert [c.index for c in r.choices] == [0, 1]
    for c in r.choices:
        content = c.logprobs.content
        assert len(content) == 6
        assert all(len(t.top_logprobs) == 3 for t in content)
        assert all(t.top_logprobs[0].logprob >= t.logprob for t in content)


def test_embedded_model_chat_is_real_text(smol_server: RunningServer) -> None:
    client = openai.OpenAI(base_url=smol_server.v1, api_key="unused", max_retries=0)
    r = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=24, temperature=0,
    )
    assert "Paris" in r.choices[0].message.content
    streamed = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=24, temperature=0, stream=True,
    )
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == (
        r.choices[0].message.content)
