"""quantization="int8" (model/quant/quantization.py): the W8A8 linear against a
dequantize-then-matmul reference on odd shapes, on the CPU's best oneDNN ISA and forced to AVX2;
and the engine on a quantized model: paging, prefix caching, chunked prefill, batching and
sampling unchanged (int32 sums are exact and activations are quantized per token, so a
quantized model is as batch-invariant as the fp32 one: greedy tokens must not depend on the
configuration)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from torch import nn

from octavo import LLM, SamplingParams
from octavo.model.kernels.cpu_isa import supported_isas
from octavo.model.kernels.cpu_ops import load_cpu_ops
from octavo.model.quant.quantization import Int8Linear, quantize_model, quantize_rows, weight_qmax
from octavo.sampling_params import BeamSearchParams


def reference(layer: Int8Linear, x: torch.Tensor) -> torch.Tensor:
    """Dequantize both sides, multiply in fp64 (exactly what the int32 sums represent)."""
    xq, xs = quantize_rows(x.reshape(-1, layer.in_features))
    out = (xq.double() * xs.double()) @ layer.dequantized_weight().double().T
    if layer.bias is not None:
        out += layer.bias.double()
    return out.reshape(*x.shape[:-1], layer.out_features)


@pytest.mark.parametrize("isa", supported_isas())
def test_int8_gemv_is_exactly_int_mm(isa):
    """The decode-sized int8 products (int8_gemv) are the exact int32 sums torch._int_mm
    gives: every row count up to INT8_GEMV_ROWS (the kernel tiles rows by 4/2/1), K with and
    without a tail past the vector width, full-range weights (-128 included) and activations;
    int8_mm, which picks between the two by rows, too."""
    ops = load_cpu_ops(isa)
    assert ops is not None
    gen = torch.Generator().manual_seed(11)
    for m in range(1, ops.INT8_GEMV_ROWS + 1):
        for n, k in ((1, 2), (7, 33), (37, 64), (100, 96), (9, 200)):
            x = torch.randint(-127, 128, (m, k), dtype=torch.int8, generator=gen)
            w = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=gen)
            want = x.int() @ w.int().t()
            assert torch.equal(ops.int8_gemv(x, w), want), (m, n, k)
            assert torch.equal(ops.int8_mm(x, w), want), (m, n, k)
    x = torch.randint(-127, 128, (ops.INT8_GEMV_ROWS + 1, 64), dtype=torch.int8, generator=gen)
    w = torch.randint(-127, 128, (5, 64), dtype=torch.int8, generator=gen)
    assert torch.equal(ops.int8_mm(x, w), x.int() @ w.int().t())  # oneDNN's side
    extreme = torch.full((2, 64), -127, dtype=torch.int8)
    w = torch.full((3, 64), -128, dtype=torch.int8)
    assert torch.equal(ops.int8_gemv(extreme, w), extreme.int() @ w.int().t())
    with pytest.raises(RuntimeError, match="int8"):
        ops.int8_gemv(torch.zeros(1, 4), torch.zeros(2, 4, dtype=torch.int8))


@pytest.mark.parametrize("tokens, k, n", [(1, 576, 1536), (3, 37, 21), (5, 64, 7),
                                          (33, 1536, 576), (2, 2, 3)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("ops", ["torch", *supported_isas()])
def test_int8_linear_equals_dequantized_matmul(tokens, k, n, bias, ops):
    """In torch and through each build of the compiled quantize / epilogue ops."""
    gen = torch.Generator().manual_seed(k * n + tokens)
    linear = nn.Linear(k, n, bias=bias)
    linear.weight.data = torch.randn(n, k, generator=gen)
    if bias:
        linear.bias.data = torch.randn(n, generator=gen)
    layer = Int8Linear.from_linear(linear)
    if ops != "torch":
        layer.ops = load_cpu_ops(ops)
        assert layer.ops is not None and layer.ops.isa() == ops
    assert layer.weight_q.dtype == torch.int8
    assert layer.weight_q.abs().max() == weight_qmax()  # each row's largest weight hits it
    x = torch.randn(tokens, k, generator=gen) * 3
    got = layer(x)
    torch.testing.assert_close(got.double(), reference(layer, x), atol=1e-4, rtol=1e-5)
    # quantization error against the fp32 layer stays at int8's scale
    assert (got - linear(x)).abs().max() < 0.05 * linear(x).abs().max() + 0.05
    # 3-d input and bf16 activations (the output comes back in the input's dtype)
    x3 = x.reshape(1, tokens, k).bfloat16()
    got3 = layer(x3)
    assert got3.dtype == torch.bfloat16 and got3.shape == (1, tokens, n)
    torch.testing.assert_close(got3.double(), reference(layer, x3.float()), atol=0.05,
                               rtol=2e-2)


def test_int8_linear_on_the_avx2_path():
    """The same check with oneDNN capped at AVX2, in a fresh process (oneDNN reads
    ONEDNN_MAX_CPU_ISA once). Whether that kernel saturates full-range weights depends on the
    CPU (some take a VNNI-style path even capped); weight_qmax measures it, and the layer must
    be exact with whichever range it chose."""
    code = (
        "import torch, sys\n"
        "from torch import nn\n"
        "from tests.model.quant.test_quantization import Int8Linear, reference\n"
        "torch.manual_seed(0)\n"
        "from octavo.model.quant.quantization import weight_qmax\n"
        "assert weight_qmax() in (63, 127), weight_qmax()\n"
        "for t, k, n in ((1, 576, 1536), (7, 37, 21), (33, 1536, 576), (2, 2, 16)):\n"
        "    layer = Int8Linear.from_linear(nn.Linear(k, n))\n"
        "    x = torch.randn(t, k) * 3\n"
        "    torch.testing.assert_close(layer(x).double(), reference(layer, x), atol=1e-4,"
        " rtol=1e-5)\n"
        "print('ok')\n"
    )
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2", "ONEDNN_VERBOSE": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=300, cwd=os.getcwd())
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.rstrip().endswith("ok")
    if "onednn_verbose" in out.stdout:  # where torch's int8 GEMM is oneDNN's, it ran capped
        assert "isa:Intel AVX2" in out.stdout


def test_quantize_model_takes_every_linear_layer_and_reports_bytes(tiny_llama_dir):
    from octavo.config import ModelConfig
    from octavo.model.worker.runner import load_model

    config = ModelConfig.from_dir(tiny_llama_dir)
    model = load_model(tiny_llama_dir, config, torch.float32, torch.device("cpu"), 128,
                       linear_backend="torch")
    report = quantize_model(model, "int8")
    assert type(model.lm_head) is Int8Linear  # as llama.cpp's Q8_0 files quantize output
    assert type(model.embed_tokens) is nn.Embedding  # the lookup keeps its dtype
    assert report.layers == 4 * config.num_layers + 1
    assert report.bytes_after < report.bytes_before / 3 and report.saved_bytes > 0
    with pytest.raises(ValueError, match="quantization='int3' is not one of"):
        quantize_model(model, "int3")


@pytest.fixture(scope="module", params=["int8", "int4"])
def quant_reference(request, tiny_llama_dir):
    """(scheme, greedy tokens of the quantized tiny model, batched, block size 16, nothing
    else on)."""
    llm = LLM(str(tiny_llama_dir), quantization=request.param, block_size=16,
              num_kv_blocks=128)
    return request.param, llm.generate(PROMPTS, GREEDY, use_tqdm=False)


PROMPTS = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (5, 40, 100)] + [
    {"prompt_token_ids": list(range(3, 3 + 40)) + [7, 8, 9]}]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.mark.parametrize("options", [
    dict(block_size=1, enable_prefix_caching=False),
    dict(block_size=16, enable_prefix_caching=True, max_num_batched_tokens=32),
    dict(block_size=16, num_kv_blocks=10, max_num_batched_tokens=32),  # preemption
    dict(block_size=16, attention_backend="torch", fused_ops="torch", linear_backend="torch"),
], ids=["bs1", "prefix-chunked", "preempt", "torch-kernels"])
def test_engine_on_a_quantized_model_is_configuration_invariant(tiny_llama_dir, quant_reference,
                                                                options):
    """int8 and int4 (the 4-bit block kernels; gguf's engine runs are in
    test_gguf_weights.py): block size, prefix caching with chunked prefill, preemption and
    the torch fallbacks give the same greedy tokens."""
    scheme, reference = quant_reference
    want = [o.outputs[0].token_ids for o in reference]
    llm = LLM(str(tiny_llama_dir), quantization=scheme, **{"num_kv_blocks": 128, **options})
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert got == want
    alone = llm.generate(PROMPTS[1], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert alone == want[1]
    stats = llm.stats()
    assert stats["kv_blocks_used"] == 0 and stats["quantization_saved_bytes"] > 0
    if options.get("num_kv_blocks") == 10:
        assert stats["num_preemptions"] > 0
    if options.get("enable_prefix_caching"):
        assert stats["prefix_cache_hit_tokens"] > 0


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_sampling_features_on_a_quantized_model(tiny_llama_dir, scheme):
    llm = LLM(str(tiny_llama_dir), quantization=scheme, block_size=16, num_kv_blocks=128)
    params = SamplingParams(n=3, temperature=0.8, seed=7, max_tokens=10, logprobs=2,
                            ignore_eos=True)
    a = llm.generate(PROMPTS[1], params, use_tqdm=False)[0]
    b = llm.generate(PROMPTS[1], params, use_tqdm=False)[0]
    assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]  # seeded
    assert all(len(o.logprobs) == 10 for o in a.outputs)
    beams = llm.beam_search([PROMPTS[0]], BeamSearchParams(beam_width=2, max_tokens=6))
    assert len(beams[0].sequences) == 2
    assert llm.engine.executor.runner.kernel_path()["quantization"] == scheme
    assert llm.stats()["kv_blocks_used"] == 0
