"""`quantization="gguf"`: a GGUF model's Q4_0, Q4_1, Q8_0, Q4_K, Q5_K and Q6_K linear weights
kept in their blocks and computed directly (block_quant.py), instead of the dequantized fp32
copy the loader makes of every tensor (loader.py). Tensors of other types keep that copy, as do
the token embeddings (a lookup, not a matmul) and the norms.

The blocks are read with the `gguf` package (which transformers' GGUF loading uses too), turned
into the formats octavo computes in (gguf_blocks.py) and given the rows the HF layout has: GGUF's
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

import torch
from torch import nn

from octavo.config import ModelConfig
from octavo.model.quant.gguf_blocks import FORMATS, Blocks, _planes, block_linears, fused_linear
from octavo.model.quant.quantization import QuantReport

logger = logging.getLogger(__name__)

GGUF_ARCH = "llama"  # the architecture whose tensor names and permutations this maps


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

    def get(self, name: str, rows_perm: torch.Tensor | None = None) -> Blocks | None:
        """Tensor `name` in its block format (gguf_blocks.py), rows in the order `rows_perm`,
        or None when its type has none (the loader's fp32 copy stays)."""
        t = self.tensors.get(name)
        if t is None or t.tensor_type.name not in FORMATS:
            return None
        cols, rows = int(t.shape[0]), int(t.shape[1])
        blocks = _planes(t.tensor_type.name, t.data, rows, cols)
        if blocks is None:
            logger.warning("GGUF tensor %s: Q4_0 scales too large for float16 mins; it is "
                           "dequantized instead", name)
            return None
        return blocks.rows(rows_perm)

    def type_name(self, name: str) -> str | None:
        t = self.tensors.get(name)
        return None if t is None else t.tensor_type.name


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
    dequantized: Counter[str] = Counter()
    # a weight another module also holds (a tied LM head's is the embedding's) stays in memory
    holders = Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    for parent, attr, sources in plan:
        linear = getattr(parent, attr)
        if type(linear) is not nn.Linear:
            continue
        layer = fused_linear([blocks.get(name, perm) for name, perm in sources], linear.bias)
        if layer is None:  # another type: the layer keeps the dequantized weight
            for name, _ in sources:
                kind = blocks.type_name(name)
                if kind is not None and kind not in FORMATS and kind != "F32":
                    dequantized[kind] += 1
            continue
        if (layer.out_features, layer.in_features) != tuple(linear.weight.shape):
            raise ValueError(f"GGUF blocks for {attr} are [{layer.out_features}, "
                             f"{layer.in_features}], the layer is {tuple(linear.weight.shape)}")
        layer.ops = ops
        if holders[id(linear.weight)] == 1:
            before += linear.weight.numel() * linear.weight.element_size()
        after += layer.nbytes()
        layers += 1
        formats["+".join(p.fmt.name for p in block_linears(layer))] += 1
        setattr(parent, attr, layer)
    if dequantized:
        logger.info("quantization gguf: linear weights of types octavo does not compute in "
                    "blocks are dequantized to fp32: %s (in blocks: %s)",
                    ", ".join(f"{k} x{v}" for k, v in sorted(dequantized.items())),
                    ", ".join(FORMATS))
    if layers == 0:
        raise ValueError(f"{str(gguf_path)!r} has no {', '.join(FORMATS)} linear weights; "
                         "quantization='gguf' has nothing to keep in blocks")
    report = QuantReport("gguf", layers, before, after)
    logger.info("quantization gguf: %d linear layers kept in GGUF blocks (%s) from %s; weights "
                "%.1f MiB -> %.1f MiB", layers, ", ".join(f"{k} x{v}" for k, v in formats.items()),
                gguf_path.name, before / 2**20, after / 2**20)
    return report
