"""Stop conditions on real greedy outputs of the embedded model: stop strings spanning token
boundaries (truncation, include_stop_str_in_output, stop_reason), stop_token_ids, EOS,
min_tokens (EOS suppressed until then), max_tokens."""

from __future__ import annotations

import pytest
import torch

from octavo import LLM, SamplingParams
from tests.engine.conftest import tokens_prompt

EOS = 2  # <|im_end|>


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(num_kv_blocks=256)


@pytest.fixture(scope="module")
def chat_prompt(llm) -> list[int]:
    return llm.apply_chat_template([{"role": "user", "content": "Say hello."}])


@pytest.fixture(scope="module")
def greedy(llm, chat_prompt):
    """The reference greedy answer: longer than 20 tokens, ends with EOS."""
    out = llm.generate(tokens_prompt(chat_prompt), SamplingParams(temperature=0, max_tokens=64),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason is None
    assert out.token_ids[-1] == EOS and EOS not in out.token_ids[:-1]
    assert len(out.token_ids) > 20 and "<|im_end|>" not in out.text
    return out


def char_spans(tokenizer, token_ids: list[int]) -> list[tuple[int, int]]:
    """(start, end) of each token's characters in the decoded text of all tokens."""
    spans, prev = [], 0
    for k in range(1, len(token_ids) + 1):
        end = len(tokenizer.decode(token_ids[:k], skip_special_tokens=True))
        spans.append((prev, end))
        prev = end
    return spans


def spanning_stop_string(tokenizer, greedy) -> tuple[str, int, int]:
    """A stop string made of the last 2 characters of token i and the first 2 of token i + 1,
    whose first occurrence in the text is that one. Returns (stop, i, start)."""
    text, ids = greedy.text, greedy.token_ids[:-1]
    spans = char_spans(tokenizer, ids)
    assert tokenizer.decode(ids, skip_special_tokens=True) == text
    for i in range(2, len(ids) - 1):
        (s0, e0), (s1, e1) = spans[i], spans[i + 1]
        if e0 - s0 >= 2 and e1 - s1 >= 2 and e0 == s1:
            stop = text[e0 - 2 : s1 + 2]
            if text.find(stop) == e0 - 2 and stop.strip() == stop:
                return stop, i, e0 - 2
    raise AssertionError(f"no token pair to build a spanning stop string in {text!r}")


def test_stop_string_across_token_boundary(llm, chat_prompt, greedy):
    stop, i, start = spanning_stop_string(llm.get_tokenizer(), greedy)
    text = greedy.text
    for include in (False, True):
        params = SamplingParams(temperature=0, max_tokens=64, stop=["@@never@@", stop],
                                include_stop_str_in_output=include)
        out = llm.generate(tokens_prompt(chat_prompt), params, use_tqdm=False)[0].outputs[0]
        assert out.finish_reason == "stop"
        assert out.stop_reason == stop
        # generation stopped at the token that completed the stop string
        assert out.token_ids == greedy.token_ids[: i + 2]
        assert out.text == (text[: start + len(stop)] if include else text[:start])
    # the earliest occurrence wins, whatever the order of the stop list
    later = text[-8:-2]
    assert text.find(later) > start
    out = llm.generate(tokens_prompt(chat_prompt),
                       SamplingParams(temperature=0, max_tokens=64, stop=[later, stop]),
                       use_tqdm=False)[0].outputs[0]
    assert out.stop_reason == stop and out.text == text[:start]


def test_stop_token_ids(llm, chat_prompt, greedy):
    ids = greedy.token_ids
    k = next(j for j in range(3, len(ids)) if ids[j] not in ids[:j] and ids[j] != EOS)
    params = SamplingParams(temperature=0, max_tokens=64, stop_token_ids=[ids[k]])
    out = llm.generate(tokens_prompt(chat_prompt), params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == ids[: k + 1]
    assert out.finish_reason == "stop" and out.stop_reason == ids[k]
    tok = llm.get_tokenizer()
    assert out.text == tok.decode(ids[: k + 1], skip_special_tokens=True)


def test_max_tokens_is_length(llm, chat_prompt, greedy):
    out = llm.generate(tokens_prompt(chat_prompt), SamplingParams(temperature=0, max_tokens=5),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == greedy.token_ids[:5]
    assert out.finish_reason == "length" and out.stop_reason is None
    # ignore_eos runs past EOS up to max_tokens
    n = len(greedy.token_ids) + 4
    out = llm.generate(tokens_prompt(chat_prompt),
                       SamplingParams(temperature=0, max_tokens=n, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids[: len(greedy.token_ids)] == greedy.token_ids
    assert len(out.token_ids) == n and out.finish_reason == "length"


def test_min_tokens_suppresses_eos(llm, chat_prompt, greedy, hf_model):
    eos_at = len(greedy.token_ids) - 1
    min_tokens = eos_at + 6
    params = SamplingParams(temperature=0, max_tokens=min_tokens + 10, min_tokens=min_tokens)
    out = llm.generate(tokens_prompt(chat_prompt), params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids[:eos_at] == greedy.token_ids[:eos_at]
    assert len(out.token_ids) >= min_tokens
    assert EOS not in out.token_ids[:min_tokens]
    if out.finish_reason == "stop":
        assert out.token_ids[-1] == EOS and len(out.token_ids) > min_tokens
    else:
        assert out.finish_reason == "length" and len(out.token_ids) == min_tokens + 10
    # the same as HF's min_new_tokens (EOS masked to -inf until then)
    ids = torch.tensor([chat_prompt])
    with torch.no_grad():
        ref = hf_model.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False,
            max_new_tokens=min_tokens + 10, min_new_tokens=min_tokens, eos_token_id=EOS,
            pad_token_id=0,
        )[0, len(chat_prompt):].tolist()
    assert out.token_ids == ref
    # min_tokens also holds back stop token ids and stop strings
    stop_tok = greedy.token_ids[3]
    params = SamplingParams(temperature=0, max_tokens=12, min_tokens=8,
                            stop_token_ids=[stop_tok], stop=[greedy.text[:3]])
    out = llm.generate(tokens_prompt(chat_prompt), params, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) >= 8
    assert stop_tok not in out.token_ids[:8]
    assert out.text.startswith(greedy.text[:3])  # the early stop string was not acted on
    assert llm.stats()["kv_blocks_used"] == 0
