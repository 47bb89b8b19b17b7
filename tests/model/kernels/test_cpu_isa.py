"""The CPU kernels' ISA is chosen from the CPU's flags at run time, and dtype=auto follows it."""

from __future__ import annotations

import logging

import pytest
import torch

from octavo.config import ModelConfig
from octavo.model import dtype_policy
from octavo.model.dtype_policy import resolve_dtype
from octavo.model.kernels import cpu_isa
from octavo.model.kernels.cpu_isa import native_bf16, select_isa, supported_isas

AVX512_BF16 = frozenset(["avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq",
                         "avx512_bf16"])
AVX512 = AVX512_BF16 - {"avx512_bf16"}
AVX2 = frozenset(["avx2", "fma", "f16c"])
OLD = frozenset(["sse2", "sse4_2"])


@pytest.fixture(autouse=True)
def _x86(monkeypatch):
    monkeypatch.setattr(cpu_isa, "is_x86", lambda: True)


def test_best_isa_per_cpu():
    assert supported_isas(AVX512_BF16) == ["avx512", "avx2", "portable"]
    assert supported_isas(AVX2) == ["avx2", "portable"]
    assert supported_isas(OLD) == ["portable"]
    assert select_isa("auto", AVX2) == "avx2"
    assert select_isa(None, AVX512) == "avx512"
    assert select_isa("portable", AVX512) == "portable"


def test_avx2_without_fma_is_not_avx2():
    assert supported_isas(frozenset({"avx2", "f16c"})) == ["portable"]


def test_asking_for_a_missing_isa_names_the_flags():
    with pytest.raises(ValueError, match=r"cpu_isa='avx512': this CPU lacks avx512f, avx512bw"):
        select_isa("avx512", AVX2)
    with pytest.raises(ValueError, match="not one of"):
        select_isa("sse9", AVX2)


def test_no_environment_variable_changes_the_choice(monkeypatch):
    """The ISA is the engine option's alone (octavo/envs.py reads no kernel switch)."""
    monkeypatch.setenv("OCTAVO_CPU_ISA", "avx2")
    assert select_isa("auto", AVX512) == "avx512"


def test_non_x86_is_portable(monkeypatch):
    monkeypatch.setattr(cpu_isa, "is_x86", lambda: False)
    assert supported_isas(AVX512) == ["portable"]


def test_native_bf16_needs_the_flag_and_the_avx512_path():
    assert native_bf16("avx512", AVX512_BF16)
    assert native_bf16("avx512", frozenset({"amx_bf16"}) | AVX512)
    assert not native_bf16("avx512", AVX512)
    assert not native_bf16("avx2", AVX512_BF16)  # forced down: behaves like an AVX2 machine


def config(saved: str) -> ModelConfig:
    return ModelConfig.from_hf_dict({
        "model_type": "llama", "vocab_size": 32, "hidden_size": 8, "intermediate_size": 16,
        "num_hidden_layers": 1, "num_attention_heads": 2, "dtype": saved})


@pytest.mark.parametrize("saved, flags, isa, want", [
    ("float32", AVX512_BF16, "avx512", torch.float32),  # fp32 checkpoints stay exact
    ("bfloat16", AVX512_BF16, "avx512", torch.bfloat16),
    ("float16", AVX512_BF16, "avx512", torch.bfloat16),
    ("bfloat16", AVX512, "avx512", torch.float32),  # AVX-512 without bf16
    ("bfloat16", AVX2, "avx2", torch.float32),
    ("bfloat16", AVX512_BF16, "avx2", torch.float32),  # forced to the AVX2 path
])
def test_auto_dtype(monkeypatch, saved, flags, isa, want):
    monkeypatch.setattr(cpu_isa, "cpu_flags", lambda: flags)
    choice = resolve_dtype("auto", config(saved), torch.device("cpu"), isa)
    assert choice.dtype == want
    assert choice.requested == "auto" and saved in choice.reason


def test_explicit_bf16_without_native_bf16_runs_fp32_and_warns_once(monkeypatch, caplog):
    monkeypatch.setattr(cpu_isa, "cpu_flags", lambda: AVX2)
    monkeypatch.setattr(dtype_policy, "_warned", set())
    with caplog.at_level(logging.WARNING, logger="octavo.model.dtype_policy"):
        first = resolve_dtype("bfloat16", config("bfloat16"), torch.device("cpu"), "avx2")
        again = resolve_dtype("bfloat16", config("bfloat16"), torch.device("cpu"), "avx2")
    assert first.dtype == again.dtype == torch.float32
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "no native bf16" in warnings[0].getMessage()


def test_explicit_dtypes_kept_where_native(monkeypatch):
    monkeypatch.setattr(cpu_isa, "cpu_flags", lambda: AVX512_BF16)
    for name, want in dtype_policy.DTYPES.items():
        assert resolve_dtype(name, config("float32"), torch.device("cpu"), "avx512").dtype == want


def test_auto_on_cuda_keeps_a_16_bit_checkpoint():
    cuda = torch.device("cuda")
    assert resolve_dtype("auto", config("float16"), cuda, "none").dtype == torch.float16
    assert resolve_dtype("auto", config("float32"), cuda, "none").dtype == torch.float32


def test_torch_dtype_spelling_is_read():
    cfg = ModelConfig.from_hf_dict({**config("float32").hf, "dtype": None,
                                    "torch_dtype": "bfloat16"})
    assert cfg.checkpoint_dtype == "bfloat16"


@pytest.mark.skipif("avx2" not in supported_isas(), reason="needs a CPU with AVX2")
def test_engine_forced_to_avx2_runs_bf16_in_fp32_with_the_fp32_tokens(tiny_llama_dir):
    """An AVX-512 machine forced to the AVX2 path behaves like an AVX2 machine: bf16 asked
    for computes in fp32 (no 16-bit cliff), and says so in its kernel path."""
    from octavo import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = [{"prompt_token_ids": [1, 2, 3, 4, 5]}, {"prompt_token_ids": list(range(7, 40))}]
    forced = LLM(model=str(tiny_llama_dir), dtype="bfloat16", cpu_isa="avx2")
    path = forced.engine.runner.kernel_path()
    assert path["dtype"] == "float32" and path["dtype_requested"] == "bfloat16"
    assert path["isa"] == "avx2" and not path["prefill_bf16_dot"]
    assert next(forced.engine.runner.model.parameters()).dtype == torch.float32
    fp32 = LLM(model=str(tiny_llama_dir), dtype="float32", cpu_isa="avx2")
    got = [o.outputs[0].token_ids for o in forced.generate(prompts, params, use_tqdm=False)]
    want = [o.outputs[0].token_ids for o in fp32.generate(prompts, params, use_tqdm=False)]
    assert got == want


@pytest.mark.skipif(supported_isas()[0] != "avx512" or "avx512_bf16" not in cpu_isa.cpu_flags(),
                    reason="needs avx512_bf16")
def test_bf16_engine_takes_bf16_dot_products_in_prefill(tiny_llama_dir):
    """On a CPU with native bf16, a bf16 engine's prefill attention runs on bf16 dot products
    (the kernel tests check their results), and its kernel path says so; fp32 does not."""
    from octavo import LLM

    bf16 = LLM(model=str(tiny_llama_dir), dtype="bfloat16")
    assert bf16.engine.runner.kernel_path()["prefill_bf16_dot"]
    fp32 = LLM(model=str(tiny_llama_dir), dtype="float32")
    assert not fp32.engine.runner.kernel_path()["prefill_bf16_dot"]
