"""The bounds a prompt's text meets before any thread spends long on it (server/tokenizing.py,
template_render.py) and the other pieces of the front door that need no server: the JSON
depth scan, the byte-capped response store, llguidance's errors as a client sees them, the
allowed Host names."""

from __future__ import annotations

import json
import random

import pytest

from octavo.engine.structured_output import error_text
from octavo.server.args import ServerConfig
from octavo.server.body_limits import json_depth
from octavo.server.errors import OpenAIError
from octavo.server.middleware import host_name
from octavo.server.responses.store import ResponseStore, StoredResponse, entry_bytes
from octavo.server.tokenizing import CHUNK_CHARS, BoundedTokenizer

SLOW_TEMPLATE = ("{% for i in range(6000) %}{% for j in range(6000) %}{% endfor %}{% endfor %}"
                 "{{ messages[0]['content'] }}")


class CountingTokenizer:
    """A tokenizer whose encode() adds up the characters it was given."""

    def __init__(self, tokenizer) -> None:
        self.inner = tokenizer
        self.chars = 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def encode(self, text, **kw):
        self.chars += len(text)
        return self.inner.encode(text, **kw)


@pytest.fixture(scope="module")
def bounded(tokenizer) -> BoundedTokenizer:
    return BoundedTokenizer(CountingTokenizer(tokenizer), 8192, chat_template_timeout=0.3)


def cjk(n: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    return "".join(map(chr, rng.choices(range(0x4E00, 0xA000), k=n)))


def test_a_huge_cjk_prompt_is_refused_after_tokenizing_a_bounded_share_of_it(bounded):
    """600,000 CJK characters pass the character bound (8192 tokens of up to 81 characters),
    yet hold ~1.6 M tokens: counting them in pieces stops after a few pieces."""
    text = cjk(600_000)
    assert len(text) < bounded.max_prompt_chars
    bounded.tokenizer.chars = 0
    with pytest.raises(OpenAIError, match="maximum context length is 8192 tokens") as e:
        bounded.encode(text)
    assert e.value.status == 400 and e.value.param == "prompt"
    assert bounded.tokenizer.chars <= 4 * CHUNK_CHARS  # not 600,000


def test_prompts_that_fit_keep_their_exact_token_ids(bounded, tokenizer):
    for text in ("short", cjk(1500, seed=1), "word " * 6000, cjk(3000, seed=2) + " tail"):
        assert bounded.encode(text) == tokenizer.encode(text)
    # a text of more characters than max_model_len, few enough tokens: counted, then whole
    text = "a " * 6000
    assert bounded.encode(text, add_special_tokens=False) == tokenizer.encode(
        text, add_special_tokens=False)


def test_every_render_is_bounded_in_time_the_models_own_template_too(tiny_llama_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_llama_dir))
    tok.chat_template = SLOW_TEMPLATE
    bounded = BoundedTokenizer(tok, 512, chat_template_timeout=0.2)
    hi = [{"role": "user", "content": "hi"}]
    with pytest.raises(OpenAIError, match="ran longer than 0.2 s") as e:
        bounded.render(hi)
    assert e.value.status == 400
    tok.chat_template = "{{ messages[0]['content'] }}!"  # the thread renders the next one
    assert bounded.render(hi) == "hi!"
    assert bounded.apply_chat_template(hi) == list(b"hi!")


def test_what_a_request_may_pass_to_the_template(tiny_llama_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_llama_dir))
    hi = [{"role": "user", "content": "hi"}]
    own = "{{ 'mine: ' + messages[0]['content'] }}"
    strict = BoundedTokenizer(tok, 512, chat_template_timeout=1)
    for kwargs, template in (({}, own), ({"chat_template": own}, None)):
        with pytest.raises(OpenAIError, match="--trust-request-chat-template"):
            strict.render(hi, template_kwargs=kwargs, chat_template=template)
    for key in ("tokenize", "messages", "tools", "return_dict", "tokenizer_kwargs",
                "return_assistant_tokens_mask", "documents"):
        with pytest.raises(OpenAIError, match=f"may not set '{key}'") as e:
            strict.render(hi, template_kwargs={key: True})
        assert e.value.param == "chat_template_kwargs"
    trusting = BoundedTokenizer(tok, 512, chat_template_timeout=1,
                                trust_request_chat_template=True)
    assert trusting.render(hi, chat_template=own) == "mine: hi"
    assert trusting.render(hi, template_kwargs={"chat_template": own}) == "mine: hi"
    with pytest.raises(OpenAIError, match="non-empty string"):
        trusting.render(hi, template_kwargs={"chat_template": 5})


def test_json_depth_skips_brackets_inside_strings():
    assert json_depth(b'{"a": 1}') == 1
    assert json_depth(rb'{"a": [1, {"b": "[[[[\\\"{{"}]}') == 3
    assert json_depth(rb'["\\", [[]]]') == 3  # an escaped backslash ends before the quote
    assert json_depth(b'"[[[[[[[[[["') == 0
    deep = json.dumps({"x": json.loads("[" * 500 + "]" * 500)}).encode()
    assert json_depth(deep) == 501
    assert json_depth(b"") == 0 and json_depth(b"not json [") == 1


def test_the_response_store_is_capped_in_bytes():
    entry = StoredResponse({"id": "x", "text": "a" * 1000})
    size = entry_bytes(entry)
    store = ResponseStore(100, max_bytes=3 * size)
    for name in "abcd":
        assert store.put(name, StoredResponse({"id": "x", "text": "a" * 1000}))
    assert "a" not in store and len(store) == 3 and store.num_bytes == 3 * size
    assert not store.put("huge", StoredResponse({"id": "huge", "text": "a" * 4 * size}))
    assert "huge" not in store and len(store) == 3
    assert store.delete("b") and store.num_bytes == 2 * size


def test_llguidance_errors_lose_their_backtraces():
    panic = ("called `Result::unwrap()` on an `Err` value: too many states\n<backtrace>\n"
             "   0: llguidance::api\n             at src/lib.rs:12\n</backtrace>")
    assert error_text(panic) == "called `Result::unwrap()` on an `Err` value: too many states"
    assert error_text("regex parse error:\n    ([\n     ^\nerror: unclosed class") == (
        "regex parse error: / ([ / ^ / error: unclosed class")
    assert error_text("x" * 2000).endswith("...") and len(error_text("x" * 2000)) < 410
    assert error_text("\n") == "the grammar compiler failed"


def test_allowed_hosts_default_to_the_loopback_names_on_a_loopback_address():
    loopback = ServerConfig().hosts_allowed("127.0.0.1")
    assert loopback == {"localhost", "127.0.0.1", "::1"}
    assert ServerConfig().hosts_allowed("::1") is not None
    assert ServerConfig().hosts_allowed("0.0.0.0") is None
    assert ServerConfig(allowed_hosts=["*"]).hosts_allowed("127.0.0.1") is None
    assert ServerConfig(allowed_hosts=["API.example"]).hosts_allowed("0.0.0.0") == {
        "api.example"}
    for header, name in ((b"localhost:8000", "localhost"), (b"[::1]:80", "::1"),
                         (b"Example.COM", "example.com"), (b"::1", "::1")):
        assert host_name(header) == name
