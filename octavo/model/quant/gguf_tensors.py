"""A GGUF file's tensors under the names transformers gives them, as transformers maps them.

The families' loaders (`load_hf_state_dict` and its `_load_*` steps) read HF checkpoint
names; `GGUFTensors` answers those names from a GGUF file, one tensor at a time, dequantized
to fp32 when asked for. The mapping is transformers' (modeling_gguf_pytorch_utils.py):

- names: gguf-py's table for the architecture (`get_tensor_name_map`), HF name -> GGUF name;
- llama files (Mistral's too) store q and k with their rows permuted for llama.cpp's RoPE:
  the permutation is undone (`unpermute_rows`, the same row order on weights and blocks);
- Gemma 2 and 3 files store every norm weight as 1 + w: 1 is taken off again;
- Qwen2-MoE stores each layer's experts stacked, gate and up apart: they become transformers'
  `experts.gate_up_proj` [E, 2I, H] and `experts.down_proj` [E, H, I]; the shared expert's
  gate vector becomes a [1, H] weight.

With `meta` (True, or a set of names) those tensors come back as meta tensors of their shape,
without reading a byte: the loader traces the families' loading with them, and does not read
the tensors only block layers use (gguf_weights.py).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Collection
from functools import cached_property
from typing import Any

import torch

from octavo.model.quant import kquant
from octavo.model.quant.block_quant import dequantize
from octavo.model.quant.gguf_blocks import FORMATS, _planes
from octavo.model.quant.gguf_file import GGUFFile

# GGUF general.architecture -> the HF model_type octavo runs it as (transformers' own renames)
ARCHITECTURES: dict[str, str] = {
    "llama": "llama",  # Mistral's files too: llama.cpp stores them as llama
    "qwen2": "qwen2",
    "qwen2moe": "qwen2_moe",
    "qwen3": "qwen3",
    "phi3": "phi3",
    "gemma2": "gemma2",
    "gemma3": "gemma3_text",
}
_PERMUTED = ("llama",)  # architectures whose q/k rows llama.cpp permuted
_NORM_PLUS_ONE = ("gemma2", "gemma3")
_STACKED = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")


def check_architecture(gf: GGUFFile) -> str:
    """The HF model_type of the file's architecture; a clear error for one octavo lacks."""
    arch = gf.architecture
    if arch not in ARCHITECTURES:
        raise ValueError(
            f"GGUF file {str(gf.path)!r} has architecture {arch!r}; octavo runs GGUF files of "
            f"these architectures: {', '.join(ARCHITECTURES)}")
    if arch == "llama" and int(gf.arch_get("expert_count", 0) or 0) > 0:
        raise ValueError(f"GGUF file {str(gf.path)!r} is a mixture-of-experts llama file "
                         "(Mixtral); octavo does not run those from GGUF yet")
    return ARCHITECTURES[arch]


def unpermute_rows(n: int, heads: int) -> torch.Tensor:
    """The row order transformers' reverse_permute_weights gives a [n, ...] q or k weight."""
    idx = torch.arange(n)
    dim = n // heads // 2
    return idx.reshape(heads, dim, 2).swapaxes(2, 1).reshape(n)


class GGUFTensors:
    """HF checkpoint name -> fp32 tensor from a GGUF file (see the module docstring), read
    as a family's loader reads a checkpoint (`name in t`, `t[name]`)."""

    def __init__(self, gf: GGUFFile, num_heads: int, num_kv_heads: int, num_layers: int,
                 meta: bool | Collection[str] = (), ops: Any = None) -> None:
        self.file = gf
        self.ops = ops  # the compiled CPU ops: their block_dequantize widens the block formats
        self.widened: Counter[str] = Counter()  # GGML type -> tensors read as floats
        self.arch = gf.architecture
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.num_layers = num_layers
        self.meta = meta

    @cached_property
    def _name_map(self) -> Any:
        from gguf.constants import MODEL_ARCH_NAMES
        from gguf.tensor_mapping import get_tensor_name_map

        arch = next(a for a, name in MODEL_ARCH_NAMES.items() if name == self.arch)
        return get_tensor_name_map(arch, self.num_layers)

    # ---- names --------------------------------------------------------------------------
    def gguf_names(self, hf_name: str) -> list[str] | None:
        """The GGUF tensors `hf_name` is made of (two for stacked gate/up experts); None when
        the name maps to nothing the file holds."""
        stacked = _STACKED.match(hf_name)
        if stacked:
            layer, which = stacked.groups()
            parts = ("gate", "up") if which == "gate_up_proj" else ("down",)
            names = [f"blk.{layer}.ffn_{p}_exps.weight" for p in parts]
        else:
            base, dot, suffix = hf_name.rpartition(".")
            if suffix not in ("weight", "bias"):
                return None
            name = self._name_map.get_name(base)
            if name is None:
                return None
            names = [f"{name}{dot}{suffix}"]
        return names if all(n in self.file.tensors for n in names) else None

    def rows_perm(self, gguf_name: str) -> torch.Tensor | None:
        """The row order that undoes llama.cpp's q/k permutation (None: rows as stored)."""
        if self.arch not in _PERMUTED:
            return None
        info = self.file.tensors[gguf_name]
        if ".attn_q." in gguf_name:
            return unpermute_rows(info.shape[0], self.num_heads)
        if ".attn_k." in gguf_name:
            return unpermute_rows(info.shape[0], self.num_kv_heads)
        return None

    def block_source(self, hf_name: str) -> tuple[str, torch.Tensor | None] | None:
        """(GGUF name, row order) when `hf_name` is one GGUF tensor taken as stored, rows aside
        (so its blocks can stand for it); None when transformers changes its values or shape."""
        names = self.gguf_names(hf_name)
        if names is None or len(names) != 1 or self._changes_values(names[0]):
            return None
        return names[0], self.rows_perm(names[0])

    def _changes_values(self, gguf_name: str) -> bool:
        return self._plus_one(gguf_name) or "ffn_gate_inp_shexp" in gguf_name

    def _plus_one(self, gguf_name: str) -> bool:
        return self.arch in _NORM_PLUS_ONE and "norm.weight" in gguf_name

    # ---- values -------------------------------------------------------------------------
    def __contains__(self, hf_name: object) -> bool:
        return isinstance(hf_name, str) and self.gguf_names(hf_name) is not None

    def shape(self, hf_name: str) -> tuple[int, ...]:
        names = self._names(hf_name)
        shapes = [self.file.tensors[n].shape for n in names]
        if len(shapes) == 2:  # gate and up experts, stacked along the rows of each expert
            e, i, h = shapes[0]
            return (e, 2 * i, h)
        if "ffn_gate_inp_shexp" in names[0] and len(shapes[0]) == 1:
            return (1, *shapes[0])
        return shapes[0]

    def __getitem__(self, hf_name: str) -> torch.Tensor:
        if self.meta is True or (not isinstance(self.meta, bool) and hf_name in self.meta):
            return torch.empty(self.shape(hf_name), device="meta")
        names = self._names(hf_name)
        parts = [self._processed(n) for n in names]
        out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
        if "ffn_gate_inp_shexp" in names[0] and out.ndim == 1:
            out = out[None, :]
        return out.contiguous()

    def _names(self, hf_name: str) -> list[str]:
        names = self.gguf_names(hf_name)
        if names is None:
            raise KeyError(hf_name)
        return names

    def _processed(self, gguf_name: str) -> torch.Tensor:
        self.widened[self.file.tensors[gguf_name].type_name] += 1
        w = _dequantize(self.file, gguf_name, self.ops)
        perm = self.rows_perm(gguf_name)
        if perm is not None:
            w = w[perm]
        if self._plus_one(gguf_name):
            w = w - 1.0
        return w


def _dequantize(gf: GGUFFile, name: str, ops: Any) -> torch.Tensor:
    """A tensor in fp32: the block formats widened by the compiled kernels (or torch; the same
    numbers as gguf-py's, bit for bit, which tests/model/quant/test_gguf_weights.py and
    test_kquant.py check, and many times faster), the other types by gguf-py."""
    info = gf.tensors[name]
    if info.type_name in FORMATS and len(info.shape) == 2:
        blocks = _planes(info.type_name, gf.raw(name), info.rows, info.cols)
        if blocks is not None:
            fmt, q, scale, mins = blocks
            if fmt.kquant:
                if ops is not None:
                    return ops.kquant_dequantize(fmt.kind, q, 0, info.rows, None)
                return kquant.dequantize(fmt.kind, q)
            if ops is not None:
                return ops.block_dequantize(fmt.kind, q, scale, mins, fmt.group, 0, info.rows,
                                            None)
            return dequantize(fmt.kind, q, scale, mins, fmt.group)
    return torch.from_numpy(gf.dequantize(name))
