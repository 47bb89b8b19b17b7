"""Tiny random-weight HF models of every family octavo runs from GGUF, written as GGUF files the
way llama.cpp's convert_hf_to_gguf.py writes them (the layout transformers' GGUF loading
reverses): gguf-py's tensor names, llama's q/k rows permuted for llama.cpp's RoPE, Gemma's norm
weights stored as 1 + w, Qwen2-MoE's experts stacked with gate and up apart, and the metadata
keys each architecture has. Tensors are F32 (1-D), Q8_0 / Q4_0 (gguf-py's `quantize`) and
Q4_K / Q6_K (encoded here: gguf-py quantizes no K-quant; its `dequantize` checks the encoding).

Each tiny config keeps transformers' defaults wherever the GGUF metadata says nothing (the
Qwen2-MoE expert sizes, Qwen3's head size, Gemma's attention scalar and soft caps), so that
transformers reading the file builds the model the file came from.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from tests.conftest import _bytes_to_unicode

COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
              rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)

# family -> (GGUF architecture, HF config class, HF model class, config over COMMON)
FAMILIES: dict[str, tuple[str, str, str, dict]] = {
    "llama": ("llama", "LlamaConfig", "LlamaForCausalLM", {"head_dim": 16}),
    "qwen2": ("qwen2", "Qwen2Config", "Qwen2ForCausalLM", {"tie_word_embeddings": True}),
    "qwen3": ("qwen3", "Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 128}),
    "qwen2_moe": ("qwen2moe", "Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 1408,
                   "shared_expert_intermediate_size": 5632}),
    "phi3": ("phi3", "Phi3Config", "Phi3ForCausalLM", {"pad_token_id": 0}),
    "gemma2": ("gemma2", "Gemma2Config", "Gemma2ForCausalLM",
               {"head_dim": 16, "sliding_window": 24, "tie_word_embeddings": True}),
    "gemma3_text": ("gemma3", "Gemma3TextConfig", "Gemma3ForCausalLM",
                    {"head_dim": 16, "sliding_window": 24, "num_hidden_layers": 6,
                     "tie_word_embeddings": True}),
}
CHAT_TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"


def build_hf(family: str, seed: int = 0):
    """The family's tiny random HF model; norms and biases moved off their trivial init."""
    import transformers

    _, config_cls, model_cls, extra = FAMILIES[family]
    torch.manual_seed(seed)
    config = getattr(transformers, config_cls)(**{**COMMON, **extra})
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model


def default_qtype(name: str, shape: tuple[int, ...]):
    """F32 vectors and routers, Q4_K / Q6_K where rows are whole super-blocks of 256 (the FFN
    down projections), Q4_0 for attn_output, Q8_0 for every other matrix."""
    from gguf import GGMLQuantizationType as T

    if len(shape) == 1 or ".ffn_gate_inp." in name:
        return T.F32
    if shape[-1] % 256 == 0:
        return T.Q6_K if name.startswith("blk.1.") else T.Q4_K
    if ".attn_output." in name:
        return T.Q4_0
    return T.Q8_0


def write_gguf(model, family: str, out: Path,
               qtype: Callable[[str, tuple[int, ...]], object] = default_qtype) -> Path:
    """`model` (build_hf's) as a GGUF file of the family's architecture."""
    import gguf
    from gguf.constants import MODEL_ARCH_NAMES

    arch = FAMILIES[family][0]
    cfg = model.config
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    arch_enum = next(a for a, n in MODEL_ARCH_NAMES.items() if n == arch)
    names = gguf.get_tensor_name_map(arch_enum, cfg.num_hidden_layers)
    w = gguf.GGUFWriter(str(out), arch)
    w.add_name(f"tiny-{family}")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(float(cfg.rope_parameters.get("rope_theta", 10000.0)
                               if "full_attention" not in cfg.rope_parameters
                               else cfg.rope_parameters["full_attention"]["rope_theta"]))
    w.add_vocab_size(cfg.vocab_size)
    if arch == "llama":
        w.add_rope_dimension_count(head_dim)
    else:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if arch.startswith("gemma"):
        w.add_sliding_window(cfg.sliding_window)
    if arch == "gemma2":
        w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        w.add_final_logit_softcapping(cfg.final_logit_softcapping)
    if arch == "qwen2moe":
        w.add_expert_count(cfg.num_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(_bytes_to_unicode())
    w.add_token_scores([0.0] * 256)
    w.add_token_types([1] * 256)
    w.add_bos_token_id(cfg.bos_token_id)
    w.add_eos_token_id(cfg.eos_token_id)
    w.add_pad_token_id(getattr(cfg, "pad_token_id", None) or 0)
    w.add_chat_template(CHAT_TEMPLATE)
    for hf_name, t in model.state_dict().items():
        if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # tied: llama.cpp writes no output tensor
        for gguf_name, value in _gguf_tensors(hf_name, t.float().numpy(), names, arch, heads,
                                              kv_heads):
            kind = qtype(gguf_name, value.shape)
            if kind == gguf.GGMLQuantizationType.F32:
                w.add_tensor(gguf_name, np.ascontiguousarray(value, dtype=np.float32))
            else:
                w.add_tensor(gguf_name, quantize(value, kind), raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's HF -> GGUF permutation of q/k rows (LlamaModel.permute)."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def _gguf_tensors(hf_name: str, value: np.ndarray, names, arch: str, heads: int,
                  kv_heads: int) -> list[tuple[str, np.ndarray]]:
    """The GGUF tensors an HF tensor becomes (convert_hf_to_gguf.py's modify_tensors)."""
    if hf_name.endswith("mlp.experts.gate_up_proj"):  # [E, 2I, H]: gate rows, then up rows
        layer = hf_name.split(".")[2]
        gate, up = np.split(value, 2, axis=1)
        return [(f"blk.{layer}.ffn_gate_exps.weight", gate),
                (f"blk.{layer}.ffn_up_exps.weight", up)]
    if hf_name.endswith("mlp.experts.down_proj"):
        return [(f"blk.{hf_name.split('.')[2]}.ffn_down_exps.weight", value)]
    base, _, suffix = hf_name.rpartition(".")
    name = names.get_name(base)
    if name is None:
        raise KeyError(f"no GGUF name for {hf_name}")
    if arch == "llama" and base.endswith("self_attn.q_proj"):
        value = _permute(value, heads)
    elif arch == "llama" and base.endswith("self_attn.k_proj"):
        value = _permute(value, kv_heads)
    if arch.startswith("gemma") and hf_name.endswith("norm.weight"):
        value = value + 1  # Gemma's (1 + w) norms, stored as llama.cpp applies them
    if name.endswith("ffn_gate_inp_shexp"):
        value = value.reshape(-1)
    return [(f"{name}.{suffix}", value)]


# ---- quantization ---------------------------------------------------------------------------

def quantize(value: np.ndarray, kind) -> np.ndarray:
    """A float array as the raw blocks of GGML type `kind`, [..., bytes per row]."""
    import gguf.quants
    from gguf import GGMLQuantizationType as T

    value = np.ascontiguousarray(value, dtype=np.float32)
    if kind == T.Q4_K:
        return _k_rows(value, _q4_k_block)
    if kind == T.Q6_K:
        return _k_rows(value, _q6_k_block)
    return gguf.quants.quantize(value, kind)


def _k_rows(value: np.ndarray, block: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
    rows = value.reshape(-1, 256)
    out = np.stack([block(r) for r in rows])
    return out.reshape(*value.shape[:-1], -1)


def _f16(x: float) -> np.ndarray:
    return np.array([x], dtype=np.float16).view(np.uint8)


def _q4_k_block(x: np.ndarray) -> np.ndarray:
    """256 weights as Q4_K: d, dmin (f16), 8 x (6-bit scale, 6-bit min), 4-bit quants;
    w = d * sc * q - dmin * m per sub-block of 32."""
    sub = x.reshape(8, 32)
    lo = np.minimum(sub.min(axis=1), 0.0)
    scale = (sub.max(axis=1) - lo) / 15
    d = np.float16(scale.max() / 63 or 1e-8)
    dmin = np.float16((-lo).max() / 63 or 1e-8)
    sc = np.clip(np.round(scale / np.float32(d)), 1, 63).astype(np.uint8)
    mn = np.clip(np.round(-lo / np.float32(dmin)), 0, 63).astype(np.uint8)
    step = np.float32(d) * sc.astype(np.float32)
    offset = np.float32(dmin) * mn.astype(np.float32)
    q = np.clip(np.round((sub + offset[:, None]) / step[:, None]), 0, 15).astype(np.uint8)
    scales = np.concatenate([sc[:4] | ((sc[4:] >> 4) << 6), mn[:4] | ((mn[4:] >> 4) << 6),
                             (sc[4:] & 0xF) | ((mn[4:] & 0xF) << 4)]).astype(np.uint8)
    qs = (q.reshape(4, 2, 32)[:, 0] | (q.reshape(4, 2, 32)[:, 1] << 4)).reshape(-1)
    return np.concatenate([_f16(d), _f16(dmin), scales, qs.astype(np.uint8)])


def _q6_k_block(x: np.ndarray) -> np.ndarray:
    """256 weights as Q6_K: 6-bit quants (low 4 bits, high 2 bits apart), an int8 scale per
    16, one f16 d; w = d * scale * (q - 32)."""
    sub = x.reshape(16, 16)
    scale = np.abs(sub).max(axis=1) / 31
    d = np.float16(scale.max() / 127 or 1e-8)
    sc = np.clip(np.round(scale / np.float32(d)), 1, 127).astype(np.int8)
    step = np.float32(d) * sc.astype(np.float32)
    q = (np.clip(np.round(sub / step[:, None]), -32, 31) + 32).astype(np.uint8).reshape(8, 32)
    ql = np.zeros(128, np.uint8)
    qh = np.zeros(64, np.uint8)
    for r in range(8):  # row r of 32: half r // 4, nibble (r // 2) % 2, part r % 2
        h, n, part, s = r // 4, (r // 2) % 2, r % 2, r % 4
        ql[h * 64 + part * 32: h * 64 + part * 32 + 32] |= (q[r] & 0xF) << (4 * n)
        qh[h * 32: h * 32 + 32] |= (q[r] >> 4) << (2 * s)
    return np.concatenate([ql, qh, sc.view(np.uint8), _f16(d)])
