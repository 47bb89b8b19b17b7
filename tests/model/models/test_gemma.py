"""Gemma 2 and Gemma 3 (text), as tiny random-weight HF models built here, give HF transformers'
greedy tokens in fp32: batched and one by one, block sizes 1 / 16 / 256, prefix caching on and
off, under preemption with chunked prefill. Sliding windows of 16 / 24 tokens, so that most
prompts (3..160 tokens, plus 32 generated) run well past the window on the local layers;
Gemma 2 with both soft caps, Gemma 3 with its two rope bases and an attention soft cap too."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from octavo.config import ModelConfig
from octavo.model.layers.attention.base import AttentionMetadata, PrefillChunk
from octavo.model.layers.attention.torch_backend import TorchAttentionBackend
from tests.model.models.test_families import CONFIGS, build_model, check_greedy, hf_greedy, prompts

COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=4,
              num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
              rms_norm_eps=1e-6, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
              pad_token_id=0, query_pre_attn_scalar=24)

FAMILIES = {
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM",
               dict(num_hidden_layers=3, sliding_window=16, attn_logit_softcapping=5.0,
                    final_logit_softcapping=3.0)),
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM",
                    dict(num_hidden_layers=4, sliding_window=24, sliding_window_pattern=2,
                         rope_parameters={
                             "full_attention": {"rope_type": "linear", "factor": 2.0,
                                                "rope_theta": 100000.0},
                             "sliding_attention": {"rope_type": "default",
                                                   "rope_theta": 1000.0}},
                         final_logit_softcapping=4.0)),
}


def perturb_norms(name: str, p: torch.Tensor) -> None:
    if "norm" in name:  # Gemma's norms start at zero (weights 1 + w): give them something
        p.add_(torch.randn_like(p) * 0.3)


def build(path: Path, family: str) -> Path:
    return build_model(path, FAMILIES[family], COMMON, seed=3, perturb=perturb_norms,
                       eager=True)


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    path = build(tmp_path_factory.mktemp(request.param), request.param)
    ps = prompts()
    return request.param, path, ps, hf_greedy(path, ps, attn_implementation="eager")


@pytest.mark.parametrize("config", list(CONFIGS))
def test_greedy_equals_transformers(family, config) -> None:
    llm = check_greedy(*family, config)
    # the window does not cap the length: local layers really attend locally
    assert llm.engine.max_model_len > FAMILIES[family[0]][2]["sliding_window"]


def test_configs_parse(tmp_path) -> None:
    g3 = ModelConfig.from_dir(build(tmp_path / "g3", "gemma3_text"))
    assert (g3.head_dim, g3.sliding_window, g3.rope_theta) == (32, 24, 100000.0)
    assert g3.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert g3.max_len[0] == 512


def _reference(q, keys, values, q_pos, window, softcap, scale):
    """Per query, per head: softmax over the keys it sees, in float64."""
    group = q.shape[1] // keys.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float64)
    for i, p in enumerate(q_pos):
        lo = 0 if window is None else max(0, p - window + 1)
        for h in range(q.shape[1]):
            k, v = keys[lo : p + 1, h // group].double(), values[lo : p + 1, h // group].double()
            s = k @ q[i, h].double() * scale
            if softcap is not None:
                s = torch.tanh(s / softcap) * softcap
            out[i, h] = torch.softmax(s, 0) @ v
    return out


@pytest.mark.parametrize("window,softcap", [(5, None), (None, 2.0), (7, 3.0)])
@pytest.mark.parametrize("backend_name", ["torch", "cpu"])
def test_backend_window_and_softcap(window, softcap, backend_name) -> None:
    """A decode of two sequences and a prefill chunk from an offset, against a direct loop."""
    from octavo.model.layers.attention import get_backend

    if backend_name == "cpu":
        backend = get_backend("auto", torch.device("cpu"))
        if type(backend) is TorchAttentionBackend:
            pytest.skip("compiled CPU kernel not available")
    else:
        backend = TorchAttentionBackend()
    torch.manual_seed(0)
    bs, heads, kvh, d, nblocks = 4, 4, 2, 16, 32
    k_cache = torch.zeros(nblocks, bs, kvh, d)
    v_cache = torch.zeros(nblocks, bs, kvh, d)
    lens = [13, 9, 20]  # two decodes with these context lengths, then a 6-token chunk at 14
    seq_k = [torch.randn(n, kvh, d) for n in lens]
    seq_v = [torch.randn(n, kvh, d) for n in lens]
    tables = [torch.arange(i * 8, i * 8 + 8) for i in range(3)]
    # everything but each sequence's new tokens is already cached
    new = [1, 1, 6]
    for t, n, k, v in zip(tables, lens, seq_k, seq_v, strict=True):
        for pos in range(n):
            k_cache[t[pos // bs], pos % bs] = k[pos]
            v_cache[t[pos // bs], pos % bs] = v[pos]
    q = torch.randn(sum(new), heads, d)
    k = torch.cat([seq_k[i][lens[i] - new[i]:] for i in range(3)])
    v = torch.cat([seq_v[i][lens[i] - new[i]:] for i in range(3)])
    slots = [int(tables[i][p // bs]) * bs + p % bs for i in range(3)
             for p in range(lens[i] - new[i], lens[i])]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots), num_decodes=2,
        decode_block_tables=torch.stack(tables[:2]), decode_context_lens=torch.tensor(lens[:2]),
        prefills=[PrefillChunk(2, 8, lens[2] - 6, tables[2])])
    scale = d**-0.5
    out = backend.forward(q, k, v, k_cache, v_cache, meta, scale, window=window, softcap=softcap)
    rows = [(0, [lens[0] - 1]), (1, [lens[1] - 1]), (2, list(range(lens[2] - 6, lens[2])))]
    start = 0
    for seq, q_pos in rows:
        ref = _reference(q[start : start + len(q_pos)], seq_k[seq], seq_v[seq], q_pos, window,
                         softcap, scale)
        torch.testing.assert_close(out[start : start + len(q_pos)].double(), ref, atol=1e-5,
                                   rtol=1e-5)
        start += len(q_pos)


@pytest.mark.parametrize("rows", [1, 7, 64])
def test_fused_norm_is_gemmas(rows) -> None:
    """GemmaRMSNorm through the compiled rms_norm (1 + w as the weight, fp32 rows) against its
    torch ops; bf16 rows and unfused norms keep the torch ops."""
    from octavo.model.kernels.cpu_ops import load_cpu_ops
    from octavo.model.models.gemma import GemmaRMSNorm

    ops = load_cpu_ops()
    if ops is None:
        pytest.skip("the compiled CPU ops are not built here")
    gen = torch.Generator().manual_seed(rows)
    norm = GemmaRMSNorm(640, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(640, generator=gen) * 0.3)
    x = torch.randn(rows, 640, generator=gen) * 3
    with torch.inference_mode():
        want, want_bf16 = norm(x), norm(x.bfloat16())
        norm.use_fused(ops)
        torch.testing.assert_close(norm(x), want, atol=1e-5, rtol=1e-5)
        assert torch.equal(norm(x.bfloat16()), want_bf16)
        norm.use_fused(None)
        assert torch.equal(norm(x), want)
