"""quantization="gguf" (model/quant/gguf_weights.py, gguf_blocks.py, model/gguf_loader.py): a
GGUF file's Q4_0 / Q4_1 / Q5_0 / Q8_0 weights kept in their blocks (the K-quants:
test_kquant.py), the model filled straight from the file. The key check: every block layer
widens to exactly the fp32 weight transformers reads from the same file (rows unpermuted,
q/k/v and gate/up concatenated), on the embedded default model (Q4_1, its LM head tied to a
Q8_0 embedding, the lookup reading the same blocks) and on a tiny GGUF written here with Q4_0,
Q4_1, Q5_0 and Q8_0 tensors, and the tensors kept in blocks are never widened at load; then the
engine on both, the errors, and the block parsing against GGUF's formulas on hand-made bytes."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from octavo import LLM, SamplingParams
from octavo.config import ModelConfig
from octavo.model import sources
from octavo.model.hf_reference import hf_reference_dir
from octavo.model.kernels.cpu_ops import load_cpu_ops
from octavo.model.quant import gguf_tensors
from octavo.model.quant.block_concat import BlockConcat
from octavo.model.quant.block_quant import (
    INT4,
    INT5,
    INT8,
    BlockQuantLinear,
    dequantize,
    unpack_fives,
)
from octavo.model.quant.gguf_blocks import FORMATS, _planes
from octavo.model.quant.gguf_file import GGUFFile
from octavo.model.quant.gguf_tensors import check_architecture, unpermute_rows
from octavo.model.quant.gguf_weights import BlockEmbedding
from octavo.model.quant.quantization import weight_bytes
from octavo.model.sources import find_embedded_gguf, gguf_source
from octavo.model.worker.runner import load_model

PROJECTIONS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


def hf_weight(state: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """The fp32 weight of one octavo linear layer from transformers' tensors."""
    if name == "lm_head":
        return state.get("lm_head.weight", state["model.embed_tokens.weight"])
    if name == "embed_tokens.table":  # the lookup's blocks (a tied head's, named here first)
        return state["model.embed_tokens.weight"]
    prefix = "model." + name.rsplit(".", 1)[0] + "."
    parts = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
    sources = parts.get(name.rsplit(".", 1)[1], (name.rsplit(".", 1)[1],))
    return torch.cat([state[f"{prefix}{s}.weight"] for s in sources])


def reference_state(model) -> dict[str, torch.Tensor]:
    """transformers' fp32 reading of the model's GGUF file."""
    from safetensors.torch import load_file

    return load_file(str(hf_reference_dir(model) / "model.safetensors"))


def load_fp32(model_dir, quantization=None):
    config = ModelConfig.from_dir(model_dir)
    model = load_model(model_dir, config, torch.float32, torch.device("cpu"), 64,
                       linear_backend="torch", fused_ops="torch", quantization=quantization)
    return model, config


# ---- the embedded default model ----------------------------------------------------------------

@pytest.fixture(scope="module")
def default_blocks():
    """The default model loaded in blocks, and the GGUF tensors the loader widened to fp32."""
    widened: list[str] = []
    processed = gguf_tensors.GGUFTensors._processed

    def recording(self, name):
        widened.append(name)
        return processed(self, name)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf_tensors.GGUFTensors, "_processed", recording)
        model, config = load_fp32(sources.resolve_model_dir(None), quantization="gguf")
    return model, config, model.quant_report, widened


def test_default_model_layers_become_gguf_blocks(default_blocks):
    model, config, report, widened = default_blocks
    for i, layer in enumerate(model.layers):
        for path in PROJECTIONS:
            got = layer.get_submodule(path)
            assert type(got) is BlockQuantLinear, (i, path)
            assert got.fmt == FORMATS["Q4_1"][0] and got.fmt.name == "q4_1"
            assert (got.fmt.kind, got.fmt.group, got.fmt.int8_activations) == (INT4, 32, True)
            assert got.ops is None  # fused_ops="torch": the torch fallback
    head = model.lm_head
    assert type(head) is BlockQuantLinear and head.fmt.name == "q8_0"
    assert (head.fmt.kind, head.fmt.group) == (INT8, 32) and head.mins is None
    # the lookup widens its rows of the tied head's blocks: no fp32 copy of the embedding
    assert type(model.embed_tokens) is BlockEmbedding and model.embed_tokens.table is head
    # the projections, the head and the embedding's lookup (of the head's blocks)
    assert report.method == "gguf" and report.layers == 4 * config.num_layers + 2
    blocks = [m for m in model.modules() if isinstance(m, BlockQuantLinear)]
    assert report.bytes_after == sum(m.nbytes() for m in blocks)
    # Q4_1: 20 bytes a block of 32 weights, Q8_0: 34
    weights = sum(m.in_features * m.out_features for m in blocks)
    head_weights = head.in_features * head.out_features
    assert report.bytes_after == (weights - head_weights) // 32 * 20 + head_weights // 32 * 34
    assert report.bytes_before == weights * 4
    # in memory: the blocks and the norms (and the RoPE tables), no more
    dense = sum(p.numel() * 4 for p in model.parameters())
    rope = sum(b.numel() * 4 for b in model.rotary.buffers())
    assert weight_bytes(model) == dense + report.bytes_after + rope
    assert dense == (2 * config.num_layers + 1) * config.hidden_size * 4
    # the loader widened only the norms: no projection's or the embedding's tensor
    assert sorted(widened) == sorted(["output_norm.weight"] + [
        f"blk.{i}.{n}.weight" for i in range(config.num_layers)
        for n in ("attn_norm", "ffn_norm")])


def test_default_model_blocks_widen_to_transformers_weights_exactly(default_blocks):
    """Bit for bit: transformers' reading of this very file (q and k with GGUF's rope
    permutation undone); the tied LM head is the Q8_0 embedding."""
    model, config, _, _ = default_blocks
    state = reference_state(None)
    assert config.tie_word_embeddings and "lm_head.weight" not in state
    checked = 0
    for name, module in model.named_modules():
        if isinstance(module, BlockQuantLinear):
            want = hf_weight(state, name.removeprefix("model."))
            got = module.dequantized_weight()
            assert got.shape == want.shape, name
            assert torch.equal(got, want), (name, (got - want).abs().max())
            checked += 1
    assert checked == 4 * config.num_layers + 1
    ids = torch.tensor([0, 5, config.vocab_size - 1, 5])
    assert torch.equal(model.embed_tokens(ids), state["model.embed_tokens.weight"][ids])


def test_default_model_gguf_layers_compute_like_the_fp32_ones(default_blocks):
    """One layer's output, against the fp32 weight it came from: the same up to the int8
    activations, decode-sized batches and prefill-sized ones alike."""
    model, _, _, _ = default_blocks
    layer = model.layers[3].mlp.down_proj
    w = layer.dequantized_weight()
    gen = torch.Generator().manual_seed(0)
    for m in (1, 5, 40):
        x = torch.randn(m, layer.in_features, generator=gen)
        want = x @ w.T
        got = layer(x)
        err = (got - want).abs().max() / want.abs().max()
        assert err < 0.02, (m, err)


GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=5)
GGUF_PROMPTS = ["1, 2, 3, 4, 5, 6,", "Monday, Tuesday, Wednesday,"]


def test_engine_gguf_on_the_default_model():
    """Greedy tokens against the fp32 engine on the same model (whose weights are the same
    blocks, dequantized): decode computes with int8 activations, so near-ties may flip.
    Measured: 32 of 32 tokens agree (avx512 and avx2 kernels, and torch); other prompts gave
    23 to 30 of 32, each time diverging first at a near-tie. Wherever a prompt first diverges
    the fp32 model must have been near a tie (the token taken in its top 5, within 1 nat of
    its best)."""
    ref = LLM(num_kv_blocks=64, max_model_len=256)
    want = ref.generate(GGUF_PROMPTS, GREEDY, use_tqdm=False)
    del ref
    llm = LLM(quantization="gguf", num_kv_blocks=64, max_model_len=256)
    got = llm.generate(GGUF_PROMPTS, GREEDY, use_tqdm=False)
    same = 0
    for g, w in zip(got, want, strict=True):
        a, b = g.outputs[0].token_ids, w.outputs[0].token_ids
        assert len(a) == len(b) == 16
        same += sum(x == y for x, y in zip(a, b, strict=True))
        first = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)
        if first is not None:
            top = w.outputs[0].logprobs[first]
            assert a[first] in top, (first, a, b)
            assert top[b[first]].logprob - top[a[first]].logprob < 1.0, (first, a, b)
    assert same >= 0.6 * 32, (same, [g.outputs[0].token_ids for g in got])
    path = llm.engine.executor.runner.kernel_path()
    assert path["quantization"] == "gguf" and path["quantization_saved_bytes"] > 0
    stats = llm.stats()
    assert stats["quantization_saved_bytes"] == path["quantization_saved_bytes"]
    assert stats["kv_blocks_used"] == 0
    blocks = [m for m in llm.engine.executor.runner.model.modules()
              if isinstance(m, BlockQuantLinear)]
    assert {m.fmt.name for m in blocks} == {"q4_1", "q8_0"}
    if load_cpu_ops() is not None:  # the compiled kernels ran, not the torch fallback
        assert all(m.ops is not None for m in blocks)


# ---- gguf_source and the errors ----------------------------------------------------------------

def test_gguf_source_of_the_default_model_is_the_embedded_file():
    model_dir = sources.resolve_model_dir(None)
    assert model_dir == sources.default_model_dir()
    assert gguf_source(model_dir) == find_embedded_gguf()
    assert not (model_dir / "model.safetensors").exists()  # config and tokenizer only


def test_gguf_source_errors(tmp_path, tiny_llama_dir):
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="needs a model given as a GGUF file.*is an HF "
                                         "directory"):
        gguf_source(hf)
    (hf / sources.GGUF_RECORD).write_text(json.dumps({"gguf": str(tmp_path / "gone.gguf")}))
    with pytest.raises(ValueError, match="gone.gguf' the model .* was made from is gone"):
        gguf_source(hf)
    real = tmp_path / "real.gguf"
    real.write_bytes(b"GGUF")
    (hf / sources.GGUF_RECORD).write_text(json.dumps({"gguf": str(real)}))
    assert gguf_source(hf) == real
    with pytest.raises(ValueError, match="quantization='gguf' needs a model given as a GGUF"):
        LLM(str(tiny_llama_dir), quantization="gguf", num_kv_blocks=16)


# ---- a tiny GGUF with Q4_0, Q4_1 and Q8_0 tensors ----------------------------------------------

_gguf_cache_dir = sources.gguf_cache_dir


@pytest.fixture(autouse=True)
def _tmp_gguf_cache(tmp_path_factory, monkeypatch):
    """Conversions of the GGUFs written here go to a throw-away folder, not $OCTAVO_CACHE."""
    root = tmp_path_factory.getbasetemp() / "gguf-weights-cache"
    monkeypatch.setattr(sources, "gguf_cache_dir", lambda p: root / _gguf_cache_dir(p).name)


def qtype_for(name: str):
    """Each tiny tensor's GGUF type; blk.1's v is Q8_0 next to Q4_0 q and k, so that layer's
    fused qkv has no single format (a BlockConcat of its parts)."""
    from gguf import GGMLQuantizationType as T

    if name == "blk.1.attn_v.weight":
        return T.Q8_0
    if name == "blk.0.ffn_down.weight":
        return T.Q5_0
    kind = name.rsplit(".", 2)[-2]
    return {"attn_q": T.Q4_0, "attn_k": T.Q4_0, "attn_v": T.Q4_0, "attn_output": T.Q4_1,
            "ffn_gate": T.Q4_1, "ffn_up": T.Q4_1, "ffn_down": T.Q8_0, "output": T.Q8_0,
            "token_embd": T.Q8_0}.get(kind)


@pytest.fixture(scope="module")
def quant_gguf(tiny_llama_dir, tmp_path_factory):
    """The tiny Llama as a GGUF whose matrices are quantized with the gguf package."""
    import gguf
    import gguf.quants

    from tests.model.test_gguf_models import write_llama_gguf

    add = gguf.GGUFWriter.add_tensor

    def add_quantized(self, name, tensor, *args, **kwargs):
        qtype = qtype_for(name)
        if qtype is None or tensor.ndim != 2:
            return add(self, name, tensor, *args, **kwargs)
        return add(self, name, gguf.quants.quantize(tensor, qtype), raw_dtype=qtype)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf.GGUFWriter, "add_tensor", add_quantized)
        path = write_llama_gguf(tiny_llama_dir, tmp_path_factory.mktemp("qgguf") / "tq.gguf")
    return path


def test_tiny_gguf_blocks_widen_to_transformers_weights_exactly(quant_gguf):
    """Q4_0 (q, k with 4 and 2 heads: the unpermutation), Q4_1 and Q8_0, an untied LM head,
    and a fused layer whose parts differ in format (each part in its own blocks)."""
    model_dir = sources.resolve_model_dir(str(quant_gguf))
    assert gguf_source(model_dir) == quant_gguf.resolve()
    with GGUFFile(quant_gguf) as gf:
        types = {t.name: t.type_name for t in gf.tensors.values()}
    assert types["blk.0.attn_q.weight"] == "Q4_0" and types["output.weight"] == "Q8_0"
    assert types["blk.0.ffn_down.weight"] == "Q5_0"
    model, config = load_fp32(model_dir, quantization="gguf")
    state = reference_state(str(quant_gguf))
    assert not config.tie_word_embeddings
    formats = {}
    for name, module in model.named_modules():
        if isinstance(module, BlockQuantLinear) and ".parts." not in name:  # not BlockConcat's
            want = hf_weight(state, name.removeprefix("model."))
            assert torch.equal(module.dequantized_weight(), want), name
            formats[name] = module.fmt.name
            assert module.ops is None  # fused_ops="torch"
    assert formats == {
        "layers.0.self_attn.qkv_proj": "q4_0", "layers.0.self_attn.o_proj": "q4_1",
        "layers.0.mlp.gate_up_proj": "q4_1", "layers.0.mlp.down_proj": "q5_0",
        "layers.1.self_attn.o_proj": "q4_1", "layers.1.mlp.gate_up_proj": "q4_1",
        "layers.1.mlp.down_proj": "q8_0", "lm_head": "q8_0", "embed_tokens.table": "q8_0"}
    mixed = model.layers[1].self_attn.qkv_proj  # Q4_0 q and k, Q8_0 v: each in its blocks
    assert type(mixed) is BlockConcat
    assert [p.fmt.name for p in mixed.parts] == ["q4_0", "q4_0", "q8_0"]
    assert torch.equal(mixed.dequantized_weight(),
                       hf_weight(state, "layers.1.self_attn.qkv_proj"))
    assert model.quant_report.layers == len(formats) + 1  # and the mixed qkv


def test_engine_gguf_on_a_tiny_gguf(quant_gguf):
    """Through the compiled kernels and through torch: the same arithmetic (int8 activations
    for decode), so the same greedy tokens (measured: all 16); as rounding x to int8 is a step
    function, an fp32 difference in the last bit may move one activation a step, so the test
    allows a late flip. Every KV block back."""
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (4, 30)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = []
    for options in ({}, dict(fused_ops="torch", attention_backend="torch")):
        llm = LLM(str(quant_gguf), quantization="gguf", num_kv_blocks=64, **options)
        outs.append([o.outputs[0].token_ids
                     for o in llm.generate(prompts, params, use_tqdm=False)])
        assert all(len(t) == 8 for t in outs[-1])
        stats = llm.stats()
        assert stats["kv_blocks_used"] == 0 and stats["quantization_saved_bytes"] > 0
        assert llm.engine.executor.runner.kernel_path()["quantization"] == "gguf"
    # the first token comes from the 34-token prefill: fp32 activations on both paths
    assert [t[0] for t in outs[0]] == [t[0] for t in outs[1]]
    same = sum(x == y for a, b in zip(*outs, strict=True) for x, y in zip(a, b, strict=True))
    assert same >= 12, outs


def test_gguf_without_block_tensors_or_of_another_architecture(tiny_llama_dir, tmp_path):
    """An F32 file: nothing to keep in blocks, so quantization='gguf' (asked for, or the
    default) runs it dequantized and says so; an architecture octavo lacks is named."""
    from tests.model.test_gguf_models import write_header_only_gguf, write_llama_gguf

    f32 = write_llama_gguf(tiny_llama_dir, tmp_path / "f32.gguf")
    llm = LLM(str(f32), quantization="gguf", num_kv_blocks=16)
    report = llm.engine.executor.runner.model.quant_report
    assert report.method == "gguf" and report.layers == 0 and report.saved_bytes == 0
    assert not any(isinstance(m, BlockQuantLinear)
                   for m in llm.engine.executor.runner.model.modules())
    other = write_header_only_gguf(tmp_path / "bert.gguf", "bert")
    with GGUFFile(other) as gf, pytest.raises(ValueError, match="architecture 'bert'; octavo "
                                                               "runs .*llama, qwen2, qwen2moe"):
        check_architecture(gf)


def test_compiled_widening_is_gguf_pys(default_blocks):
    """The loader widens Q4_0 / Q4_1 / Q8_0 with the compiled kernel where it runs: the same
    fp32 numbers as gguf-py's dequantization (transformers')."""
    import gguf.quants
    from gguf import GGMLQuantizationType

    ops = load_cpu_ops()
    if ops is None:
        pytest.skip("octavo's CPU ops do not build here")
    with GGUFFile(find_embedded_gguf()) as gf:
        for name in ("blk.0.attn_q.weight", "blk.7.ffn_down.weight", "token_embd.weight"):
            info = gf.tensors[name]
            raw = gf.raw(name)
            want = gguf.quants.dequantize(raw, GGMLQuantizationType(info.type_id))
            got = gguf_tensors._dequantize(gf, name, ops)
            assert torch.equal(got, torch.from_numpy(want.astype(np.float32))), name
            assert torch.equal(gguf_tensors._dequantize(gf, name, None), got), name


# ---- the block parsing on hand-made bytes ------------------------------------------------------

def gguf_nibbles(q: np.ndarray) -> np.ndarray:
    """[rows, cols] values 0..15 -> GGUF's bytes: element j of a block of 32 in the low nibble
    of byte j, element j + 16 in the high one."""
    rows, cols = q.shape
    blocks = q.astype(np.uint8).reshape(rows, cols // 32, 32)
    return blocks[..., :16] | (blocks[..., 16:] << 4)


def f16_bytes(a: np.ndarray) -> np.ndarray:
    return a.astype(np.float16).view(np.uint8).reshape(*a.shape, 2)


ROWS, COLS = 5, 96


@pytest.fixture
def raw_values():
    rng = np.random.default_rng(0)
    d = (rng.standard_normal((ROWS, COLS // 32)) * 0.05).astype(np.float16)
    d[0, 0], d[1, 1], d[2, 2] = 0, -0.0123, 6.0e-8  # zero, negative, float16 subnormal
    m = (rng.standard_normal((ROWS, COLS // 32)) * 0.1).astype(np.float16)
    q4 = rng.integers(0, 16, (ROWS, COLS))
    q4[3, :32] = np.arange(32) % 16  # every nibble value
    q8 = rng.integers(-128, 128, (ROWS, COLS)).astype(np.int8)
    q8[4, :2] = (-128, 127)
    return d, m, q4, q8


def expand(a: np.ndarray) -> np.ndarray:
    """A per-block value [rows, blocks] as fp32 per weight [rows, cols]."""
    return np.repeat(a.astype(np.float32), 32, axis=1)


def check_planes(type_name, raw, want):
    import gguf.quants
    from gguf import GGMLQuantizationType

    fmt, q, scale, mins = _planes(type_name, raw, ROWS, COLS)
    assert fmt is FORMATS[type_name][0]
    assert scale.dtype == torch.float16 and scale.shape == (ROWS, COLS // 32)
    got = dequantize(fmt.kind, q, scale, mins, fmt.group)
    assert got.dtype == torch.float32 and got.shape == (ROWS, COLS)
    assert torch.equal(got, torch.from_numpy(want))
    # the gguf package's own dequantization (what transformers' loader runs)
    theirs = gguf.quants.dequantize(raw, GGMLQuantizationType[type_name])
    assert torch.equal(got, torch.from_numpy(theirs.astype(np.float32)))
    return fmt, q, scale, mins


def test_planes_q4_0(raw_values):
    d, _, q4, _ = raw_values
    raw = np.concatenate([f16_bytes(d), gguf_nibbles(q4)], axis=-1).reshape(ROWS, -1)
    assert raw.shape == (ROWS, COLS // 32 * FORMATS["Q4_0"][1])
    want = (q4.astype(np.float32) - 8) * expand(d)  # w = (q - 8) d
    fmt, q, scale, mins = check_planes("Q4_0", raw, want)
    assert q.dtype == torch.uint8 and q.shape == (ROWS, COLS // 2)
    assert torch.equal(scale, torch.from_numpy(d))
    assert torch.equal(mins.float(), -8 * scale.float())  # -8 d, exact in float16


def test_planes_q4_1(raw_values):
    d, m, q4, _ = raw_values
    raw = np.concatenate([f16_bytes(d), f16_bytes(m), gguf_nibbles(q4)],
                         axis=-1).reshape(ROWS, -1)
    assert raw.shape == (ROWS, COLS // 32 * FORMATS["Q4_1"][1])
    want = q4.astype(np.float32) * expand(d) + expand(m)  # w = q d + m
    fmt, q, scale, mins = check_planes("Q4_1", raw, want)
    assert torch.equal(mins, torch.from_numpy(m))


def test_planes_q8_0(raw_values):
    d, _, _, q8 = raw_values
    quants = q8.view(np.uint8).reshape(ROWS, COLS // 32, 32)
    raw = np.concatenate([f16_bytes(d), quants], axis=-1).reshape(ROWS, -1)
    assert raw.shape == (ROWS, COLS // 32 * FORMATS["Q8_0"][1])
    want = q8.astype(np.float32) * expand(d)  # w = q d
    fmt, q, scale, mins = check_planes("Q8_0", raw, want)
    assert q.dtype == torch.int8 and torch.equal(q, torch.from_numpy(q8)) and mins is None


def test_planes_q5_0(raw_values):
    """Q5_0: a float16 d, 4 bytes whose bit j is element j's fifth bit, then the low nibbles as
    Q4_0 packs them; w = (x - 16) d with x in 0..31. Kept as the file's 20 bytes of nibbles
    and bits a block (reordered), the scale in its plane."""
    d, _, _, _ = raw_values
    rng = np.random.default_rng(1)
    x = rng.integers(0, 32, (ROWS, COLS))
    x[0, :32] = np.arange(32)  # every value, each fifth-bit position
    fifth = (x >> 4).astype(np.uint32).reshape(ROWS, COLS // 32, 32)
    high = (fifth << np.arange(32, dtype=np.uint32)).sum(-1, dtype=np.uint32)
    high_bytes = high.astype("<u4").view(np.uint8).reshape(ROWS, COLS // 32, 4)
    raw = np.concatenate([f16_bytes(d), high_bytes, gguf_nibbles(x & 0x0F)],
                         axis=-1).reshape(ROWS, -1)
    assert raw.shape == (ROWS, COLS // 32 * FORMATS["Q5_0"][1])
    want = (x.astype(np.float32) - 16) * expand(d)
    fmt, q, scale, mins = check_planes("Q5_0", raw, want)
    assert fmt.kind == INT5 and fmt.name == "q5_0" and mins is None
    assert q.dtype == torch.uint8 and q.shape == (ROWS, COLS // 32 * 20)
    assert torch.equal(unpack_fives(q), torch.from_numpy((x - 16).astype(np.int8)))


def test_planes_q4_0_large_scale_stays_dequantized():
    """-8 d overflows float16 for |d| > 8188: such a tensor is not kept in blocks (the layer
    keeps the dequantized weight) rather than turning into -inf."""
    d = np.full((1, 1), 10000, np.float16)
    q4 = np.full((1, 32), 9)
    raw = np.concatenate([f16_bytes(d), gguf_nibbles(q4)], axis=-1).reshape(1, -1)
    assert _planes("Q4_0", raw, 1, 32) is None
    ok = np.concatenate([f16_bytes(np.full((1, 1), 8000, np.float16)), gguf_nibbles(q4)],
                        axis=-1).reshape(1, -1)
    fmt, q, scale, mins = _planes("Q4_0", ok, 1, 32)
    assert torch.equal(dequantize(fmt.kind, q, scale, mins, fmt.group),
                       torch.full((1, 32), 8000.0))


def transformers_reverse_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """transformers' LlamaTensorProcessor._reverse_permute_weights (the head count already
    the kv heads' for k)."""
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def llama_cpp_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's HF -> GGUF permutation of q/k rows (convert_hf_to_gguf.py)."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


@pytest.mark.parametrize("rows, heads", [(576, 9), (192, 3), (64, 4), (32, 2), (8, 1)])
def test_unpermute_rows_is_transformers_reverse_permutation(rows, heads):
    perm = unpermute_rows(rows, heads)
    assert sorted(perm.tolist()) == list(range(rows))
    w = torch.arange(rows * 3).reshape(rows, 3)
    assert torch.equal(w[perm], transformers_reverse_permute(w, heads))
    assert torch.equal(llama_cpp_permute(w, heads)[perm], w)  # undoes llama.cpp's
