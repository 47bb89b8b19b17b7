"""Building a model from its directory: the family's class created on the meta device, its
weights loaded (this rank's slice of them under tensor parallelism), quantized or kept in their
GGUF blocks where asked, linears packed for the CPU kernels, and the fused ops chosen.

Where the directory comes from (an HF directory, a GGUF file, an installed model's name) is
sources.py's business.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from octavo.config import ModelConfig
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
    build = shards.local_config if shards is not None else config
    with torch.device("meta"):
        model = model_class(build)(build, max_positions)
    model = model.to_empty(device=device)
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                tensors[name] = f.get_tensor(name)
    if shards is not None:
        assert tp is not None
        model.shard = shards.shard
        model.load_hf_state_dict(tensors)
        parallelize(model, shards, tp)
    else:
        model.load_hf_state_dict(tensors)
    model.rotary = RotaryEmbedding(config, max_positions).to(device)
    model = model.to(dtype=dtype)
    model.rotary.to(torch.float32)  # tables stay fp32; cast per step like transformers
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
