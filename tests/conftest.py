"""Shared fixtures: a tiny random-weight Llama built in-test, and the embedded default model."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

# Under pytest-xdist (`make test` runs two workers on a 2-core machine) each worker, and every
# process it starts, computes on one thread: two workers with two spinning threads each would
# oversubscribe the cores. Set before torch is imported, which reads it once.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)  # in case a plugin imported torch before this file

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# The device the Triton tests hand their tensors to: cpu (Triton's interpreter) unless
# OCTAVO_TEST_DEVICE says cuda (scripts/gpu_check.sh). The device decides the mode, never the
# machine: Triton fixes it when it is first imported (torch._dynamo imports it, by way of
# transformers), so it is set here, before any test module loads (octavo/model/kernels/triton).
TEST_DEVICE = torch.device(os.environ.get("OCTAVO_TEST_DEVICE", "cpu"))
if TEST_DEVICE.type not in ("cpu", "cuda"):
    raise pytest.UsageError(f"OCTAVO_TEST_DEVICE={TEST_DEVICE}: cpu or cuda")
os.environ["TRITON_INTERPRET"] = "1" if TEST_DEVICE.type == "cpu" else "0"
ON_CUDA = TEST_DEVICE.type == "cuda"

TINY_CONFIG = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
)


def build_tiny_llama(path: Path, **overrides) -> Path:
    """Save a random-weight HF Llama (seeded) to `path`; no download."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**{**TINY_CONFIG, **overrides})
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(path, safe_serialization=True)
    build_byte_tokenizer(path)
    return path


def build_byte_tokenizer(path: Path) -> None:
    """A byte-level tokenizer whose 256 tokens are the 256 bytes (ids = byte values)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    byte_to_char = {b: c for b, c in zip(range(256), _bytes_to_unicode(), strict=True)}
    assert set(byte_to_char.values()) == set(alphabet)
    vocab = {byte_to_char[b]: b for b in range(256)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=byte_to_char[1], eos_token=byte_to_char[2]
    )
    fast.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    )
    fast.save_pretrained(path)


def _bytes_to_unicode() -> list[str]:
    """GPT-2's printable stand-in character for each byte value, in byte order."""
    keep = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The embedded model as an HF directory: transformers' own fp32 reading of its GGUF (what
    the tests compare against; octavo loads the same weights from the GGUF itself, and from
    here too)."""
    from octavo.model.hf_reference import hf_reference_dir

    return hf_reference_dir(None)


@pytest.fixture(scope="session")
def tokenizer(default_model_dir):
    """The embedded model's tokenizer, loaded once per session (it takes ~2 s)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(default_model_dir))


@pytest.fixture(autouse=True)
def _log_rate_limits_start_afresh():
    """Servers started by tests rate-limit octavo's log lines process-wide; a test that reads
    the log must not miss a line because an earlier test logged the same one."""
    connections = sys.modules.get("octavo.server.connections")
    if connections is not None:
        connections.reset_log_rate_limits()
