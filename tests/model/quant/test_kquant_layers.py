"""GGUF K-quants (Q4_K, Q5_K, Q6_K) kept in their super-blocks as layers (model/quant/kquant.py,
gguf_blocks.py, block_quant.py, block_concat.py), against gguf-py's dequantization on random
valid super-blocks:
- the repack the loader runs: the compiled one is torch's, and the blocks in memory hold the
  file's codes in lane order (the 6-bit scales and mins unpacked), their rows permuted and
  concatenated;
- BlockQuantLinear's paths (the kernel, the widened tiles, torch) and its row lookup; a fused
  layer whose parts are of different formats (BlockConcat); the tensors it refuses;
- a tiny model whose linears are K-quant blocks: the same greedy tokens batched and alone,
  through the C++ decode loop and through the Python layers.
The kernels themselves: test_kquant.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from octavo import LLM, SamplingParams
from octavo.model.kernels.cpu_ops import load_cpu_ops
from octavo.model.quant import block_quant, kquant
from octavo.model.quant.block_concat import BlockConcat
from octavo.model.quant.block_quant import SMALL_BATCH, BlockQuantLinear
from octavo.model.quant.gguf_blocks import (
    FORMATS,
    Blocks,
    _planes,
    block_linears,
    block_type,
    cat_rows,
    fused_linear,
)
from tests.model.quant.block_quant_helpers import ISAS, ops_for
from tests.model.quant.kquant_blocks import GGML_NAMES, quantize, random_blocks
from tests.model.quant.kquant_helpers import IDS, KINDS, check_against_references, gguf_dequantize

# ---- the formats and BlockQuantLinear --------------------------------------------------------

def file_code(kind: int, block: np.ndarray, w: int) -> int:
    """Weight w's code (0..63) in one super-block as the GGUF file packs it (llama.cpp's
    dequantize_row_q*_K), read byte by byte: the reference for the lane order."""
    if kind == kquant.Q6_K:
        h, r = divmod(w, 128)
        g, e = divmod(r, 32)  # group g of the half: low nibbles of ql, bits 2g of qh
        lo = block[64 * h + 32 * (g % 2) + e] >> (4 * (g // 2)) & 15
        return int(lo | ((block[128 + 32 * h + e] >> (2 * g) & 3) << 4))
    s, e = divmod(w, 32)
    nib = 16 if kind == kquant.Q4_K else 48
    q = block[nib + 32 * (s // 2) + e] >> (4 * (s % 2)) & 15
    if kind == kquant.Q5_K:
        q |= (block[16 + e] >> s & 1) << 4
    return int(q)


@pytest.mark.parametrize("kind", KINDS, ids=IDS)
def test_compiled_repack_is_torchs(kind):
    """The compiled repack (kquant_repack.cpp, what the loader runs) gives torch's bytes, on
    random blocks and on blocks of all-ones bits, for every ISA build; and refuses partial
    super-blocks."""
    raw = torch.from_numpy(random_blocks(kind, 9, 768, np.random.default_rng(30 + kind)))
    full = torch.full_like(raw, 255)
    want = kquant.repack(kind, raw, compiled=False, chunk=5)
    want_full = kquant.repack(kind, full, compiled=False)
    for isa in ISAS:
        ops = ops_for(isa)
        assert torch.equal(ops.kquant_repack(kind, raw), want), isa
        assert torch.equal(ops.kquant_repack(kind, full), want_full), isa
        with pytest.raises(RuntimeError, match="whole super-blocks"):
            ops.kquant_repack(kind, raw[:, :-1].contiguous())


@pytest.mark.parametrize("kind", KINDS, ids=IDS)
def test_gguf_blocks_repack_the_files_bytes(kind):
    """Q4_K / Q5_K: the 12 bytes of 6-bit scales and mins unpacked to 16 (148 and 180 bytes a
    super-block, within 3% of the file's); every format's codes in lane order: position
    p = 32 v + 4 j + b (vector v, 4-byte lane j) holds a code of sub-block j (Q6_K: j, and 8 + j
    in vectors 4-7), packed as the file packs its codes; the rest of the block unchanged."""
    name = GGML_NAMES[kind]
    assert block_type(name) and not block_type("Q3_K") and not block_type("IQ4_XS")
    fmt, size = FORMATS[name]
    assert fmt.kquant and fmt.kind == kind and fmt.group == 256 and size == kquant.FILE_BYTES[kind]
    raw = random_blocks(kind, 6, 512, np.random.default_rng(4))
    blocks = _planes(name, raw, 6, 512)
    assert isinstance(blocks, Blocks) and blocks.scale is None and blocks.mins is None
    mem = blocks.q.numpy().reshape(12, kquant.BLOCK_BYTES[kind])
    file = raw.reshape(12, size)
    assert raw.nbytes <= blocks.nbytes() <= 1.03 * raw.nbytes
    lanes = kquant._unpack(kind, torch.from_numpy(mem[:, kquant.CODES[kind]])).numpy()
    per = 16 if kind == kquant.Q6_K else 32
    for blk in (0, 7, 11):
        for p in range(256):
            v, j, b = p // 32, p % 32 // 4, p % 4
            w = int(kquant.LANE_ORDER[kind][p])
            sub = j + 8 * (v // 4) if kind == kquant.Q6_K else j
            assert w // per == sub and w % per == 4 * (v % (4 if kind == kquant.Q6_K else 8)) + b
            assert lanes[blk, p] == file_code(kind, file[blk], w), (blk, p)
    if kind == kquant.Q6_K:
        assert np.array_equal(mem[:, 192:], file[:, 192:])
    else:
        assert np.array_equal(mem[:, :4], file[:, :4])
        sc, mn = (torch.from_numpy(file[:, 4:16]).int(),) * 2
        want_sc = [(sc[:, j] & 63) if j < 4 else (sc[:, j + 4] & 15) | ((sc[:, j - 4] >> 6) << 4)
                   for j in range(8)]  # llama.cpp's get_scale_min_k4
        want_mn = [(mn[:, j + 4] & 63) if j < 4 else (mn[:, j + 4] >> 4) | ((mn[:, j] >> 6) << 4)
                   for j in range(8)]
        assert np.array_equal(mem[:, 4:12], torch.stack(want_sc, 1).numpy())
        assert np.array_equal(mem[:, 12:20], torch.stack(want_mn, 1).numpy())
    perm = torch.tensor([3, 0, 5, 1, 4, 2])
    moved = blocks.rows(perm)
    assert torch.equal(moved.q, blocks.q[perm])
    joined = cat_rows([moved, blocks])
    assert joined is not None and joined.q.shape == (12, blocks.q.shape[1])
    assert cat_rows([blocks, _planes("Q8_0", np.zeros((6, 16 * 34), np.uint8), 6, 512)]) is None
    layer = joined.linear()
    assert (layer.out_features, layer.in_features) == (12, 512)
    assert layer.nbytes() == 2 * blocks.nbytes() and layer.fmt.bits == {2: 4, 3: 5, 4: 6}[kind]
    assert torch.equal(layer.dequantized_weight()[:6], gguf_dequantize(kind, raw)[perm])


@pytest.mark.parametrize("kind", KINDS, ids=IDS)
@pytest.mark.parametrize("ops_name", ["torch", *ISAS])
def test_block_quant_linear_paths(ops_name, kind, monkeypatch):
    """The kernel at every batch size (a row's result is the same whatever the batch); the
    widened tiles + GEMM (_tiled, several tiles here) with the activations quantized as the
    kernel's are; without the compiled ops, torch. All against the same references."""
    n, k = 37, 512
    raw = random_blocks(kind, n, k, np.random.default_rng(5))
    gen = torch.Generator().manual_seed(6)
    bias = torch.randn(n, generator=gen)
    layer = BlockQuantLinear(FORMATS[GGML_NAMES[kind]][0],
                             kquant.repack(kind, torch.from_numpy(raw)), None, None, bias)
    if ops_name != "torch":
        layer.ops = ops_for(ops_name)
    monkeypatch.setattr(block_quant, "TILE_ELEMENTS", 16 * k)
    w = gguf_dequantize(kind, raw)
    xs = torch.randn(40, k, generator=gen)
    for m in (1, 7, SMALL_BATCH, SMALL_BATCH + 1, 40):
        x = xs[:m]
        got = layer(x)
        assert got.shape == (m, n)
        check_against_references(got, x, w, bias)
        if ops_name != "torch":
            assert torch.equal(got, layer(xs)[:m])  # batch-invariant, bit for bit
            check_against_references(layer._tiled(x), x, w, bias)
    x = torch.randn(2, 3, k, generator=gen)
    assert torch.equal(layer(x), layer(x.reshape(6, k)).reshape(2, 3, n))
    ids = torch.tensor([[4, 0], [36, 4]])
    rows = layer.dequantize_rows(ids)
    assert rows.shape == (4, k) and torch.equal(rows, w[ids.reshape(-1)])


@pytest.mark.parametrize("ops_name", ["torch", *ISAS])
def test_fused_layer_of_mixed_formats(ops_name):
    """q/k as Q4_K and v as Q6_K (a Q4_K_M file's pattern): a BlockConcat computing each part
    in its own blocks, the bias split between them; one format: one BlockQuantLinear."""
    rng = np.random.default_rng(8)
    raws = [random_blocks(kquant.Q4_K, 8, 512, rng), random_blocks(kquant.Q4_K, 4, 512, rng),
            random_blocks(kquant.Q6_K, 4, 512, rng)]
    parts = [_planes(name, raw, raw.shape[0], 512)
             for name, raw in zip(("Q4_K", "Q4_K", "Q6_K"), raws, strict=True)]
    bias = torch.randn(16)
    layer = fused_linear(parts, bias)
    assert type(layer) is BlockConcat and (layer.in_features, layer.out_features) == (512, 16)
    assert [p.fmt.name for p in block_linears(layer)] == ["q4_k", "q4_k", "q6_k"]
    assert layer.nbytes() == sum(kquant.repack(k, torch.from_numpy(r)).numel() for k, r in
                                 zip((kquant.Q4_K, kquant.Q4_K, kquant.Q6_K), raws, strict=True))
    if ops_name != "torch":
        layer.ops = ops_for(ops_name)
        assert all(p.ops is layer.ops for p in layer.parts)
    w = torch.cat([gguf_dequantize(k, r) for k, r in
                   zip((kquant.Q4_K, kquant.Q4_K, kquant.Q6_K), raws, strict=True)])
    assert torch.equal(layer.dequantized_weight(), w)
    x = torch.randn(3, 512)
    check_against_references(layer(x), x, w, bias)
    ids = torch.tensor([15, 0, 9, 12])
    assert torch.equal(layer.dequantize_rows(ids), w[ids])
    same = fused_linear(parts[:2], bias[:12])
    assert type(same) is BlockQuantLinear and same.out_features == 12
    assert fused_linear([parts[0], None], None) is None
    with pytest.raises(ValueError, match="share their input features"):
        BlockConcat([parts[0].linear(), _planes("Q6_K", random_blocks(
            kquant.Q6_K, 2, 256, rng), 2, 256).linear()])


def test_block_quant_linear_rejects_bad_kquant_tensors():
    fmt = FORMATS["Q6_K"][0]
    with pytest.raises(ValueError, match="not whole super-blocks of 210 bytes"):
        BlockQuantLinear(fmt, torch.zeros(2, 200, dtype=torch.uint8), None, None, None)
    with pytest.raises(ValueError, match="scale and mins must be None"):
        BlockQuantLinear(fmt, torch.zeros(2, 210, dtype=torch.uint8),
                         torch.zeros(2, 1, dtype=torch.float16), None, None)
    with pytest.raises(ValueError, match="q must be uint8"):
        BlockQuantLinear(fmt, torch.zeros(2, 210, dtype=torch.int8), None, None, None)


def test_rows_lookup_of_32_weight_blocks():
    """dequantize_rows on the 32-weight formats too (a Q8_0 embedding kept in blocks)."""
    gen = torch.Generator().manual_seed(7)
    q, scale = block_quant.quantize_int8_blocks(torch.randn(9, 64, generator=gen))
    layer = BlockQuantLinear(FORMATS["Q8_0"][0], q, scale, None, None)
    ids = torch.tensor([8, 1, 1])
    assert torch.equal(layer.dequantize_rows(ids), layer.dequantized_weight()[ids])


# ---- a tiny model in K-quant blocks through the engine ---------------------------------------

KQUANT_TINY = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=64)


def kquant_type(name: str):
    """Each tiny tensor's GGUF type: Q4_K, Q5_K and Q6_K; layer 1's fused qkv mixes two."""
    from gguf import GGMLQuantizationType as T

    if name == "blk.1.attn_v.weight":  # a Q4_K_M file's pattern: a fused qkv of two types
        return T.Q6_K
    kind = name.rsplit(".", 2)[-2]
    return {"attn_q": T.Q4_K, "attn_k": T.Q4_K, "attn_v": T.Q4_K, "attn_output": T.Q5_K,
            "ffn_gate": T.Q4_K, "ffn_up": T.Q4_K, "ffn_down": T.Q6_K, "output": T.Q6_K,
            "token_embd": T.Q8_0}.get(kind)


@pytest.fixture(scope="module")
def kquant_gguf(tmp_path_factory):
    import gguf
    import gguf.quants

    from tests.conftest import build_tiny_llama
    from tests.model.test_gguf_models import write_llama_gguf

    hf = build_tiny_llama(tmp_path_factory.mktemp("tiny-kquant-hf"), **KQUANT_TINY)
    add = gguf.GGUFWriter.add_tensor

    def add_quantized(self, name, tensor, *args, **kwargs):
        qtype = kquant_type(name)
        if qtype is None or tensor.ndim != 2:
            return add(self, name, tensor, *args, **kwargs)
        if qtype.name in ("Q4_K", "Q5_K", "Q6_K"):
            kind = {"Q4_K": kquant.Q4_K, "Q5_K": kquant.Q5_K, "Q6_K": kquant.Q6_K}[qtype.name]
            data = quantize(kind, tensor)
        else:
            data = gguf.quants.quantize(tensor, qtype)
        return add(self, name, data, raw_dtype=qtype)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf.GGUFWriter, "add_tensor", add_quantized)
        path = write_llama_gguf(hf, tmp_path_factory.mktemp("kquant-gguf") / "tk.gguf")
    return path, tmp_path_factory.mktemp("kquant-gguf-cache")


PROMPTS = [{"prompt_token_ids": [5, 9, 77, 120]}, {"prompt_token_ids": [200, 3]},
           {"prompt_token_ids": list(range(30, 50))}]


def test_tiny_kquant_model_batched_alone_cpp_and_python(kquant_gguf, monkeypatch):
    from octavo.model import sources

    path, root = kquant_gguf
    cache_dir = sources.gguf_cache_dir  # conversions go to a throw-away folder
    monkeypatch.setattr(sources, "gguf_cache_dir", lambda p: root / cache_dir(p).name)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    runs = {}
    for stack in ("1", "0"):
        llm = LLM(str(path), quantization="gguf", num_kv_blocks=64, max_model_len=128,
                  enable_prefix_caching=False, decode_stack=stack == "1")
        model = llm.engine.executor.runner.model
        assert (model.decode_stack is not None) == (stack == "1" and load_cpu_ops() is not None)
        if model.decode_stack is not None:  # one kernel at every size: no row limit
            assert model.decode_stack.max_rows() > SMALL_BATCH
        formats = {m.fmt.name for m in model.modules() if isinstance(m, BlockQuantLinear)}
        assert formats == {"q4_k", "q5_k", "q6_k", "q8_0"}  # q8_0: the embedding's lookup
        assert model.embed_tokens.table.fmt.name == "q8_0"
        mixed = model.layers[1].self_attn.qkv_proj
        assert type(mixed) is BlockConcat
        assert [p.fmt.name for p in mixed.parts] == ["q4_k", "q4_k", "q6_k"]
        batched = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params,
                                                                use_tqdm=False)]
        alone = [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids
                 for p in PROMPTS]
        assert batched == alone
        assert all(len(t) == 12 for t in batched) and len({tuple(t) for t in batched}) > 1
        assert llm.stats()["kv_blocks_used"] == 0
        runs[stack] = batched
        del llm
    assert runs["1"] == runs["0"]
