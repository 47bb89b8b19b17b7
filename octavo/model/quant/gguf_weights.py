"""`quantization="gguf"`: a GGUF model's Q4_0, Q4_1 and Q8_0 linear weights kept in their
blocks and computed directly (block_quant.py), instead of the dequantized fp32 copy the loader
makes of every tensor (loader.py). Tensors of other types keep that copy, as do the token
embeddings (a lookup, not a matmul) and the norms.

The blocks are read with the `gguf` package (which transformers' GGUF loading uses too), split
into planes (quants, float16 scales, float16 mins) and given the rows the HF layout has: GGUF's
llama files store q_proj and k_proj with their rows permuted for llama.cpp's RoPE, which
transformers undoes on the dequantized tensors; here the same row permutation is applied to
the blocks (a row of blocks is a row of weights). q/k/v and gate/up are concatenated by rows as
the fused layers want. A tied LM head computes from the token embeddings' blocks.
"""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from octavo.config import ModelConfig
from octavo.model.quant.block_quant import INT4, INT8, BlockFormat, BlockQuantLinear
from octavo.model.quant.quantization import QuantReport

logger = logging.getLogger(__name__)

# GGML type name -> (format, bytes per block of 32)
FORMATS = {
    "Q4_0": (BlockFormat("q4_0", INT4, 32, int8_activations=True), 18),
    "Q4_1": (BlockFormat("q4_1", INT4, 32, int8_activations=True), 20),
    "Q8_0": (BlockFormat("q8_0", INT8, 32, int8_activations=True), 34),
}
GGUF_ARCH = "llama"  # the architecture whose tensor names and permutations this maps


def _planes(type_name: str, raw: np.ndarray, rows: int, cols: int):
    """A GGUF tensor's raw blocks [rows, bytes] -> (q, scale, mins) torch tensors."""
    fmt, size = FORMATS[type_name]
    blocks = np.ascontiguousarray(raw).reshape(rows, cols // 32, size)
    scale = blocks[..., 0:2].copy().view(np.float16).reshape(rows, cols // 32)
    if type_name == "Q4_0":  # w = (q - 8) d = q d + (-8 d); -8 d is exact in float16
        q = blocks[..., 2:18].reshape(rows, cols // 2)
        if np.abs(scale.astype(np.float32)).max(initial=0) * 8 > np.finfo(np.float16).max:
            return None  # -8 d overflows float16 (weights past 65504): dequantized instead
        mins = (scale.astype(np.float32) * -8).astype(np.float16)
    elif type_name == "Q4_1":
        mins = blocks[..., 2:4].copy().view(np.float16).reshape(rows, cols // 32)
        q = blocks[..., 4:20].reshape(rows, cols // 2)
    else:
        q = blocks[..., 2:34].copy().view(np.int8).reshape(rows, cols)
        mins = None
    to = torch.from_numpy
    return fmt, to(np.ascontiguousarray(q)), to(np.ascontiguousarray(scale)), (
        None if mins is None else to(np.ascontiguousarray(mins)))


def _unpermute_rows(n: int, heads: int) -> torch.Tensor:
    """The row order transformers' reverse_permute_weights gives a [n, ...] q or k weight."""
    idx = torch.arange(n)
    dim = n // heads // 2
    return idx.reshape(heads, dim, 2).swapaxes(2, 1).reshape(n)


class GGUFBlocks:
    """The block-quantized tensors of one GGUF file, by GGUF name."""

    def __init__(self, path: Path) -> None:
        from gguf import GGUFReader

        self.path = path
        self.reader = GGUFReader(str(path))
        arch = self.reader.fields.get("general.architecture")
        name = bytes(arch.parts[arch.data[0]]).decode() if arch is not None else "?"
        if name != GGUF_ARCH:
            raise ValueError(f"quantization='gguf' runs GGUF files of architecture {GGUF_ARCH!r}; "
                             f"{str(path)!r} is {name!r}")
        self.tensors = {t.name: t for t in self.reader.tensors}

    def get(self, name: str, rows_perm: torch.Tensor | None = None):
        """(format, q, scale, mins) of tensor `name`, or None when it is not Q4_0/Q4_1/Q8_0."""
        t = self.tensors.get(name)
        if t is None or t.tensor_type.name not in FORMATS:
            return None
        cols, rows = int(t.shape[0]), int(t.shape[1])
        planes = _planes(t.tensor_type.name, t.data, rows, cols)
        if planes is None:
            logger.warning("GGUF tensor %s: Q4_0 scales too large for float16 mins; it is "
                           "dequantized instead", name)
            return None
        fmt, q, scale, mins = planes
        if rows_perm is not None:
            q, scale = q[rows_perm].contiguous(), scale[rows_perm].contiguous()
            mins = None if mins is None else mins[rows_perm].contiguous()
        return fmt, q, scale, mins


def _cat(parts):
    """Concatenate (format, q, scale, mins) by rows; None unless all share one format."""
    if any(p is None for p in parts) or len({p[0] for p in parts}) != 1:
        return None
    fmt = parts[0][0]
    mins = None if parts[0][3] is None else torch.cat([p[3] for p in parts])
    return fmt, torch.cat([p[1] for p in parts]), torch.cat([p[2] for p in parts]), mins


def apply_gguf_blocks(model: nn.Module, config: ModelConfig, gguf_path: Path,
                      ops: Any = None) -> QuantReport:
    """Swap the model's linear layers whose GGUF tensors are Q4_0/Q4_1/Q8_0 for block layers
    (in place); `ops`: the compiled CPU ops they run on (None: torch)."""
    blocks = GGUFBlocks(gguf_path)
    q_perm = _unpermute_rows(config.num_heads * config.head_dim, config.num_heads)
    k_perm = _unpermute_rows(config.num_kv_heads * config.head_dim, config.num_kv_heads)
    plan: list[tuple[nn.Module, str, list[tuple[str, torch.Tensor | None]]]] = []
    for i, layer in enumerate(model.layers):
        b = f"blk.{i}."
        plan.append((layer.self_attn, "qkv_proj", [(b + "attn_q.weight", q_perm),
                                                    (b + "attn_k.weight", k_perm),
                                                    (b + "attn_v.weight", None)]))
        plan.append((layer.self_attn, "o_proj", [(b + "attn_output.weight", None)]))
        plan.append((layer.mlp, "gate_up_proj", [(b + "ffn_gate.weight", None),
                                                  (b + "ffn_up.weight", None)]))
        plan.append((layer.mlp, "down_proj", [(b + "ffn_down.weight", None)]))
    head = "output.weight" if "output.weight" in blocks.tensors else "token_embd.weight"
    plan.append((model, "lm_head", [(head, None)]))
    layers = before = after = 0
    formats: Counter[str] = Counter()
    # a weight another module also holds (a tied LM head's is the embedding's) stays in memory
    holders = Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    for parent, attr, sources in plan:
        linear = getattr(parent, attr)
        if type(linear) is not nn.Linear:
            continue
        got = _cat([blocks.get(name, perm) for name, perm in sources])
        if got is None:
            continue  # another type: the layer keeps the dequantized weight
        fmt, q, scale, mins = got
        layer = BlockQuantLinear(fmt, q, scale, mins, linear.bias)
        if (layer.out_features, layer.in_features) != tuple(linear.weight.shape):
            raise ValueError(f"GGUF blocks for {attr} are [{layer.out_features}, "
                             f"{layer.in_features}], the layer is {tuple(linear.weight.shape)}")
        layer.ops = ops
        if holders[id(linear.weight)] == 1:
            before += linear.weight.numel() * linear.weight.element_size()
        after += layer.nbytes()
        layers += 1
        formats[fmt.name] += 1
        setattr(parent, attr, layer)
    if layers == 0:
        raise ValueError(f"{str(gguf_path)!r} has no Q4_0, Q4_1 or Q8_0 linear weights; "
                         "quantization='gguf' has nothing to keep in blocks")
    report = QuantReport("gguf", layers, before, after)
    logger.info("quantization gguf: %d linear layers kept in GGUF blocks (%s) from %s; weights "
                "%.1f MiB -> %.1f MiB", layers, ", ".join(f"{k} x{v}" for k, v in formats.items()),
                gguf_path.name, before / 2**20, after / 2**20)
    return report
