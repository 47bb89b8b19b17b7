"""Decode steps without the interpreter between the layers: `DecodeStack` (csrc/decode_stack.cpp)
runs every decoder layer of a step whose rows are all single-token decodes in one C++ loop,
calling the same compiled kernels in the same order as the Python layers (layers.py), so the
logits are identical (tests/model/worker/test_decode_stack.py); prefill and mixed steps keep the
Python path, and so do decode steps of more than block_quant.SMALL_BATCH rows on a model with
32-weight block weights (their tiled path is Python's).

It applies on CPU with octavo's compiled ops and paged-decode kernel to two layer shapes,
whatever the linear layers are (oneDNN-packed fp32/bf16, int8, 4/8-bit blocks, GGUF K-quant
super-blocks, plain):
- the pre-norm Llama layer (Llama, Mistral, Qwen2, Qwen3's q/k norms, SmolLM2, ...), residual
  adds fused with the norms, SiLU MLP;
- Gemma 2 / 3's sandwich layer (gemma.py) with fp32 activations: four norms with weights 1 + w,
  q/k norms (Gemma 3), a GELU MLP, attention soft caps (Gemma 2) and local layers with their own
  rope table (Gemma 3).
Sliding-window layers and several KV cache groups (each layer reads its group's block tables)
run here too. Any other layer (MoE, SmolLM3's layers without RoPE, Gemma 4, ...), tensor
parallelism or a hook on a module keeps the Python path. The engine option `decode_stack=False`
turns it off (the benchmarks' A/B). Quantized KV pages (kv_cache_dtype) run here too: the loop
writes them with `kv_write` and reads them in `paged_decode`, as the CPU attention backend does.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from octavo.model.layers.decoder import MLP, Attention, DecoderLayer, RMSNorm
from octavo.model.layers.linear import PackedLinear
from octavo.model.models.gemma import Gemma2ForCausalLM, GemmaDecoderLayer, GemmaMLP, GemmaRMSNorm
from octavo.model.models.llama import LlamaForCausalLM
from octavo.model.quant.block_concat import BlockConcat
from octavo.model.quant.block_quant import SMALL_BATCH, BlockQuantLinear
from octavo.model.quant.quantization import Int8Linear

logger = logging.getLogger(__name__)
BLOCK, ONEDNN, INT8, PLAIN, KQUANT, CONCAT = 0, 1, 2, 3, 4, 5


def _linear_spec(m: nn.Module) -> tuple | None:
    """(type, tensors, bias, kind, group, int8_activations[, packed_gemv's arguments, or a
    concatenation's parts' specs]) for the C++ loop, or None."""
    if isinstance(m, BlockConcat):
        parts = [_linear_spec(p) for p in m.parts]
        return None if any(p is None for p in parts) else (CONCAT, [], None, 0, 0, False, parts)
    if isinstance(m, BlockQuantLinear) and m.ops is not None and m.fmt.kquant:
        return (KQUANT, [m.q], m.bias, m.fmt.kind, m.fmt.group, True)
    if isinstance(m, BlockQuantLinear) and m.ops is not None:
        tensors = [m.q, m.scale] + ([m.mins] if m.mins is not None else [])
        return (BLOCK, tensors, m.bias, m.fmt.kind, m.fmt.group, m.fmt.int8_activations)
    if isinstance(m, PackedLinear):
        return (ONEDNN, [m.packed], m.bias, 0, 0, False, m.gemv_args())
    if isinstance(m, Int8Linear) and m.ops is not None:
        return (INT8, [m.weight_q, m.weight_scale], m.bias, 0, 0, False)
    if type(m) is nn.Linear:
        return (PLAIN, [m.weight], m.bias, 0, 0, False)
    return None


def _layer_problem(layer: nn.Module, dtype: torch.dtype, eps: float) -> str | None:
    """Why this decoder layer cannot run in the loop (whose norms all take `eps`), or None."""
    attn = layer.self_attn
    if type(layer) is DecoderLayer:
        norms = [layer.input_layernorm, layer.post_attention_layernorm]
        if type(layer.mlp) is not MLP or layer.mlp.ops is None:
            return f"MLP type {type(layer.mlp).__name__} or the compiled fused ops are off"
        norm_type = RMSNorm
    elif type(layer) is GemmaDecoderLayer:
        norms = [layer.input_layernorm, layer.post_attention_layernorm,
                 layer.pre_feedforward_layernorm, layer.post_feedforward_layernorm]
        if type(layer.mlp) is not GemmaMLP:
            return f"MLP type {type(layer.mlp).__name__}"
        if dtype != torch.float32:
            return "Gemma layers outside float32"  # its fused norm is for fp32 rows only
        norm_type = GemmaRMSNorm
    else:
        return f"layer type {type(layer).__name__}"
    if type(attn) is not Attention:
        return f"attention type {type(attn).__name__}"
    if attn.q_norm is not None:
        norms += [attn.q_norm, attn.k_norm]
    if any(type(n) is not norm_type for n in norms):
        return "a norm of another type"
    if any(n.eps != eps for n in norms):
        return "norms with different eps"  # the loop takes one
    if not attn.rope:
        return "layers without RoPE"
    if attn.ops is None or any(n.ops is None for n in norms) or any(
            getattr(n, "scale", 0) is None for n in norms):
        return "the compiled fused ops are off"
    for m in (attn.qkv_proj, attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
        if _linear_spec(m) is None:
            return f"linear layer {type(m).__name__}"
    for m in layer.modules():
        if m._forward_hooks or m._forward_pre_hooks:
            return "a module hook"
    return None


def _why_not(model: nn.Module, backend: Any, dtype: torch.dtype, enabled: bool) -> str | None:
    if not enabled:
        return "decode_stack=False"
    if getattr(backend, "name", None) != "cpu":
        return "not the compiled CPU attention backend"
    if getattr(model, "shard", None) is not None:
        return "tensor parallelism"
    if type(model).forward not in (LlamaForCausalLM.forward, Gemma2ForCausalLM.forward):
        return f"{type(model).__name__} has a forward of its own"
    kinds = {type(layer) for layer in model.layers}
    if len(kinds) != 1:
        return "layers of several types"
    for layer in model.layers:
        problem = _layer_problem(layer, dtype, model.layers[0].input_layernorm.eps)
        if problem is not None:
            return problem
    first = model.layers[0].self_attn
    if any(layer.self_attn.scale != first.scale for layer in model.layers):
        return "attention scales differing by layer"
    if any((layer.self_attn.q_norm is None) != (first.q_norm is None) for layer in model.layers):
        return "q/k norms on some layers only"
    return None


def _norm_weight(norm: nn.Module) -> torch.Tensor:
    """The weight the fused rms_norm takes: GemmaRMSNorm's 1 + w, else the weight."""
    scale = getattr(norm, "scale", None)
    return norm.weight if scale is None else scale


def build_decode_stack(model: nn.Module, backend: Any, kv_groups: Any, dtype: torch.dtype,
                       enabled: bool = True) -> Any | None:
    """The C++ decode loop for `model` (activations in `dtype`), or None where the Python path
    must run (logged)."""
    problem = _why_not(model, backend, dtype, enabled)
    ops = model.layers[0].self_attn.ops if not problem else None
    if problem is None and not hasattr(ops, "DecodeStack"):
        problem = "the compiled ops lack DecodeStack"
    if problem is not None:
        logger.info("decode steps run layer by layer in Python (%s)", problem)
        return None
    first = model.layers[0]
    attn = first.self_attn
    # a block-weight layer runs its register kernel up to SMALL_BATCH rows and its tiled path
    # above (BlockQuantLinear.forward): larger steps stay in Python, so both paths compute alike
    # (K-quant layers run one kernel at every size)
    blocks = any(isinstance(m, BlockQuantLinear) and not m.fmt.kquant
                 for m in model.layers.modules())
    stack = ops.DecodeStack(attn.num_heads, attn.num_kv_heads, attn.head_dim,
                            first.input_layernorm.eps, attn.scale,
                            SMALL_BATCH if blocks else 2**62)
    sandwich = type(first) is GemmaDecoderLayer
    stack.set_style(sandwich, first.mlp.act_name if sandwich else "silu")
    local = getattr(model, "local", None) if getattr(model, "local_rope", False) else None
    for i, layer in enumerate(model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        stack.add_layer(_norm_weight(layer.input_layernorm),
                        _norm_weight(layer.post_attention_layernorm), kv_groups.layer_slot[i],
                        *(_linear_spec(m) for m in (attn.qkv_proj, attn.o_proj,
                                                    mlp.gate_up_proj, mlp.down_proj)))
        qk = attn.q_norm is not None
        stack.set_layer_options(
            kv_groups.layer_group[i], 1 if local is not None and local[i] else 0,
            attn.window or 0, attn.softcap or 0.0,
            _norm_weight(attn.q_norm) if qk else None, _norm_weight(attn.k_norm) if qk else None,
            _norm_weight(layer.pre_feedforward_layernorm) if sandwich else None,
            _norm_weight(layer.post_feedforward_layernorm) if sandwich else None)
    quant = [layer.self_attn.kv_quant for layer in model.layers]
    if quant[0] is not None and quant[0].fmt.is_fp8:  # int8 pages carry their scales
        stack.set_kv_scales([q.k_scale for q in quant], [q.v_scale for q in quant])
    if quant[0] is not None and (quant[0].k_offset is not None or quant[0].rotation is not None):
        offsets = [q.k_offset for q in quant]
        stack.set_key_smoothing([] if offsets[0] is None else offsets, quant[0].rotation)
    logger.info("decode steps run their %d layers in one C++ loop", stack.num_layers())
    return stack
