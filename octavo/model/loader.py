"""Building a model from its directory: the family's class created on the meta device in its
dtype (`create_model`: nothing is allocated before the device gets each parameter once, in the
dtype it computes in), its weights streamed from the safetensors files tensor by tensor, each
rank reading only its slice (`load_safetensors`, checkpoint.py), then quantized or kept in their
GGUF blocks where asked, linears packed for the CPU kernels, and the fused ops chosen.

Where the directory comes from (an HF directory, a GGUF file, an installed model's name) is
sources.py's business.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from octavo.config import ModelConfig
from octavo.model.checkpoint import SafetensorsCheckpoint
from octavo.model.kernels.cpu_ops import resolve_kernels, select_cpu_ops
from octavo.model.layers.decoder import RotaryEmbedding
from octavo.model.layers.linear import pack_linears
from octavo.model.models.llama import LlamaForCausalLM
from octavo.model.models.registry import model_class
from octavo.model.parallel.tensor_parallel import ShardPlan, TPGroup, parallelize
from octavo.model.quant.gguf_weights import apply_gguf_blocks
from octavo.model.quant.quantization import quantize_model
from octavo.model.sources import gguf_source


def load_model(
    model_dir: Path, config: ModelConfig, dtype: torch.dtype, device: torch.device,
    max_positions: int, linear_backend: str | None = None, fused_ops: str | None = None,
    isa: str | None = None, tp: TPGroup | None = None, quantization: str | None = None,
    group_size: int = 32, packed_gemv_rows: int | None = None,
) -> LlamaForCausalLM:
    """The model (with `tp` of size > 1: this rank's slice of it, see tensor_parallel.py;
    with `quantization`, its linear layers quantized, see quantization.py). `packed_gemv_rows`:
    the most rows a step's linear layers run packed_gemv for (0: never; None: its limit)."""
    shards = ShardPlan(config, tp.rank, tp.size) if tp is not None and tp.size > 1 else None
    model = create_model(config, max_positions, dtype, device, shards)
    load_safetensors(model, model_dir, shards)
    if shards is not None:
        assert tp is not None
        parallelize(model, shards, tp)
    if resolve_kernels("fused_ops", fused_ops, device) == "triton":
        from octavo.model.kernels.triton.fused_ops import TritonFusedOps

        ops: Any = TritonFusedOps()
    else:
        ops = select_cpu_ops("fused_ops", fused_ops, device, isa)
    # quantized layers run through the compiled CPU ops where those run
    quant_ops = ops if hasattr(ops, "quantize_rows_int8") else None
    if quantization == "gguf":
        model.quant_report = apply_gguf_blocks(model, config, gguf_source(model_dir), quant_ops)
    elif quantization is not None:
        model.quant_report = quantize_model(model, quantization, quant_ops, group=group_size)
    else:
        model.quant_report = None
    pack_linears(model, linear_backend)
    model.use_cpu_ops(ops, packed_gemv_rows)
    return model.eval()


def create_model(config: ModelConfig, max_positions: int, dtype: torch.dtype,
                 device: torch.device, shards: ShardPlan | None = None) -> LlamaForCausalLM:
    """The family's model (this rank's slice of it with `shards`), its parameters allocated on
    `device` directly in `dtype` and left unset (load_safetensors sets every one): built on
    the meta device, where the cast costs nothing."""
    build = shards.local_config if shards is not None else config
    with torch.device("meta"):
        model = model_class(build)(build, max_positions)
    model = model.to(dtype=dtype).to_empty(device=device)
    # the tables hold the values transformers' per-step cast to the model dtype gives, in fp32
    # (the compiled RoPE and the Triton kernels cast them themselves)
    rotary = RotaryEmbedding(config, max_positions).to(dtype=dtype)
    model.rotary = rotary.to(device=device, dtype=torch.float32)
    return model


def load_safetensors(model: LlamaForCausalLM, model_dir: Path,
                     shards: ShardPlan | None = None) -> None:
    """Every parameter of `model` from the checkpoint in `model_dir`, one checkpoint tensor (or
    this rank's slice of it, with `shards`) read at a time."""
    model.shard = shards.shard if shards is not None else None
    with SafetensorsCheckpoint(model_dir) as checkpoint:
        model.load_hf_state_dict(checkpoint)
