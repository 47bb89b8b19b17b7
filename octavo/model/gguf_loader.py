"""Filling a model built on the meta device straight from a GGUF file, never holding the whole
model in fp32.

1. Trace: the family's own loader (`load_hf_state_dict`) runs once over meta tensors of the
   file's shapes (quant/gguf_tensors.py names them as transformers does), which checks every
   shape and records which checkpoint tensors each parameter is made of.
2. Plan (`keep_blocks`): every linear layer whose tensors `GGUFBlocks.get` returns blocks for
   becomes a block layer (quant/gguf_weights.py); its dense weight is never allocated. The
   token embedding too (its lookup widens only the step's rows), sharing the tied LM head's
   blocks.
3. Fill: the rest is allocated in the model's dtype and loaded by the same family loader, each
   tensor dequantized on its own into fp32 and copied in (the largest transient: one tensor);
   the tensors only block layers use are never read as floats.
"""

from __future__ import annotations

import ctypes
import gc
import logging
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from torch import nn

from octavo.config import ModelConfig
from octavo.model.models.llama import LlamaForCausalLM
from octavo.model.quant.block_concat import BlockConcat
from octavo.model.quant.gguf_blocks import FORMATS, block_linears, fused_linear
from octavo.model.quant.gguf_file import GGUFFile
from octavo.model.quant.gguf_tensors import GGUFTensors, check_architecture
from octavo.model.quant.gguf_weights import BlockEmbedding, GGUFBlocks
from octavo.model.quant.quantization import QuantReport

logger = logging.getLogger(__name__)

EMBEDDING = "embed_tokens"
BlockLayer = nn.Module  # a BlockQuantLinear, or a BlockConcat of them (gguf_blocks.fused_linear)


def load_gguf(model: LlamaForCausalLM, config: ModelConfig, gguf_path: Path,
              dtype: torch.dtype, device: torch.device, keep_blocks: bool,
              shard=None, ops: Any = None) -> QuantReport | None:
    """Allocate and fill `model` (on the meta device, `to_empty` not yet called) from the
    GGUF file, in `dtype` on `device`; with `keep_blocks` the block layers take the place of
    the dense ones (their `ops` are the loader's to set). `ops`: the compiled CPU ops, which
    widen the block formats at load. Returns what was kept in blocks."""
    with GGUFFile(gguf_path) as gf:
        check_architecture(gf)
        tensors = GGUFTensors(gf, config.num_heads, config.num_kv_heads, config.num_layers,
                              ops=ops)
        sources: dict[str, list[str]] = {}
        if keep_blocks:
            tensors.meta = True
            model.load_hf_state_dict(tensors, sources=sources)
        layers = _plan_blocks(model, sources, tensors, GGUFBlocks(gf)) if keep_blocks else {}
        skip = {f"{path}.weight" for path in layers}
        for path in layers:
            model.get_submodule(path).weight = None  # never allocated
        needed = {n for param, names in sources.items() if param not in skip for n in names}
        tensors.meta = {n for names in sources.values() for n in names} - needed
        model.to(dtype=dtype)  # on the meta device: nothing to copy
        model.to_empty(device=device)
        model.shard = shard
        model.load_hf_state_dict(tensors, skip=skip)
    quantized = {k: v for k, v in tensors.widened.items() if k not in ("F32", "F16", "BF16")}
    if quantized:  # the types no block layer runs (yet), or asked for with quantization=None
        logger.info("%s: dequantized to %s at load: %s", gguf_path.name,
                    str(dtype).removeprefix("torch."),
                    ", ".join(f"{k} x{v}" for k, v in sorted(quantized.items())))
    report = _swap_in(model, layers, dtype, gguf_path) if keep_blocks else None
    _return_freed_memory()
    return report


def _return_freed_memory() -> None:
    """The load's transient copies (a tensor's planes, its rows permuted, fused parts joined;
    each a few MB) were freed into the C heap, which keeps them: glibc's malloc_trim gives them
    back to the system (measured on Qwen2.5-Coder-1.5B Q4_K_M: 230 MB of resident set)."""
    gc.collect()
    try:
        trim = ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc
        return
    trim(0)


def _plan_blocks(model: nn.Module, sources: dict[str, list[str]], tensors: GGUFTensors,
                 blocks: GGUFBlocks) -> dict[str, BlockLayer]:
    """Module path -> the block layer that replaces it (one object for modules made of the
    same tensors: a tied LM head and the embedding)."""
    made: dict[tuple[str, ...], BlockLayer | None] = {}
    layers: dict[str, BlockLayer] = {}
    for path, module in model.named_modules():
        embedding = path == EMBEDDING and type(module) is nn.Embedding
        if type(module) is not nn.Linear and not embedding:
            continue
        out_in = tuple(module.weight.shape)
        names = tuple(sources.get(f"{path}.weight", ()))
        if not names:
            continue
        if names not in made:
            found = [tensors.block_source(n) for n in names]
            made[names] = None
            if all(f is not None for f in found):
                made[names] = fused_linear([blocks.get(*f) for f in found if f is not None])
        layer = made[names]
        if layer is None:
            continue
        if (layer.out_features, layer.in_features) != out_in:
            raise ValueError(f"GGUF blocks for {path} are [{layer.out_features}, "
                             f"{layer.in_features}], the layer is {list(out_in)}")
        layers[path] = layer
    return layers


def _set_bias(layer: BlockLayer, bias: torch.Tensor) -> None:
    """The fused layer's bias, cut by rows over a BlockConcat's parts."""
    start = 0
    for part in layer.parts if isinstance(layer, BlockConcat) else [layer]:
        n = part.out_features
        part.bias = nn.Parameter(bias[start:start + n].detach().float().clone(),
                                 requires_grad=False)
        start += n


def _swap_in(model: nn.Module, layers: dict[str, BlockLayer], dtype: torch.dtype,
             gguf_path: Path) -> QuantReport:
    formats: Counter[str] = Counter()
    before = after = 0
    counted: set[int] = set()
    for path, layer in layers.items():
        parent_path, _, attr = path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        old = getattr(parent, attr)
        if id(layer) not in counted:  # a tied head and its embedding: one tensor, one layer
            counted.add(id(layer))
            before += (layer.out_features * layer.in_features
                       * torch.empty((), dtype=dtype).element_size())
            after += layer.nbytes()
            formats["+".join(p.fmt.name for p in block_linears(layer))] += 1
        if isinstance(old, nn.Embedding):
            setattr(parent, attr, BlockEmbedding(layer, dtype))
            continue
        if old.bias is not None:
            _set_bias(layer, old.bias)
        setattr(parent, attr, layer)
    report = QuantReport("gguf", len(layers), before, after)
    if layers:
        logger.info("quantization gguf: %d layers kept in GGUF blocks (%s) from %s; weights "
                    "%.1f MiB -> %.1f MiB", len(layers),
                    ", ".join(f"{k} x{v}" for k, v in formats.items()), gguf_path.name,
                    before / 2**20, after / 2**20)
    else:
        logger.warning("quantization gguf: no tensor of %s is of a type run in blocks (%s); "
                       "every weight is dequantized", gguf_path.name, ", ".join(FORMATS))
    return report
