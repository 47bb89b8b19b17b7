"""Building a model from its directory: the family's class created on the meta device, its
weights loaded (this rank's slice of them under tensor parallelism), quantized or kept in their
GGUF blocks where asked, linears packed for the CPU kernels, and the fused ops chosen.

An HF directory's safetensors are read whole; a model given as a GGUF file is filled from the
file itself, tensor by tensor (gguf_loader.py). Where the directory comes from (an HF
directory, a GGUF file, an installed model's name) is sources.py's business, as is what
`quantization="auto"` means for it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from octavo.config import ModelConfig
from octavo.model.gguf_loader import load_gguf
from octavo.model.kernels.cpu_ops import load_cpu_ops, resolve_kernels, select_cpu_ops
from octavo.model.layers.decoder import RotaryEmbedding
from octavo.model.layers.linear import pack_linears
from octavo.model.models.llama import LlamaForCausalLM
from octavo.model.models.registry import model_class
from octavo.model.parallel.tensor_parallel import ShardPlan, TPGroup, parallelize
from octavo.model.quant.block_quant import BlockQuantLinear
from octavo.model.quant.quantization import quantize_model
from octavo.model.sources import auto_quantization, gguf_source, recorded_gguf


def load_model(
    model_dir: Path, config: ModelConfig, dtype: torch.dtype, device: torch.device,
    max_positions: int, linear_backend: str | None = None, fused_ops: str | None = None,
    isa: str | None = None, tp: TPGroup | None = None, quantization: str | None = None,
    group_size: int = 32,
) -> LlamaForCausalLM:
    """The model (with `tp` of size > 1: this rank's slice of it, see tensor_parallel.py;
    with `quantization`, its linear layers quantized, see quantization.py)."""
    shards = ShardPlan(config, tp.rank, tp.size) if tp is not None and tp.size > 1 else None
    build = shards.local_config if shards is not None else config
    if quantization == "auto":
        quantization = auto_quantization(model_dir, device, shards is not None)
    gguf = recorded_gguf(model_dir)
    if quantization == "gguf" and gguf is None:
        gguf_source(model_dir)  # raises: not a model given as a GGUF file
    with torch.device("meta"):
        model = model_class(build)(build, max_positions)
    report = None
    if gguf is not None:
        report = load_gguf(model, config, gguf, dtype, device, quantization == "gguf",
                           shards.shard if shards is not None else None,
                           load_cpu_ops(isa) if device.type == "cpu" else None)
        if shards is not None:
            assert tp is not None
            parallelize(model, shards, tp)
            model = model.to(dtype=dtype)  # what parallelize made (no block layers under TP)
    else:
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
        del tensors
        model = model.to(dtype=dtype)
    model.rotary = RotaryEmbedding(config, max_positions).to(device)
    model.rotary.to(torch.float32)  # tables stay fp32; cast per step like transformers
    if resolve_kernels("fused_ops", fused_ops, device, "OCTAVO_FUSED_OPS") == "triton":
        from octavo.model.kernels.triton.fused_ops import TritonFusedOps

        ops: Any = TritonFusedOps()
    else:
        ops = select_cpu_ops("fused_ops", fused_ops, device, "OCTAVO_FUSED_OPS", isa)
    # quantized layers run through the compiled CPU ops where those run
    quant_ops = ops if hasattr(ops, "quantize_rows_int8") else None
    if quantization == "gguf":
        model.quant_report = report
        for module in model.modules():
            if isinstance(module, BlockQuantLinear):
                module.ops = quant_ops
    elif quantization is not None:
        model.quant_report = quantize_model(model, quantization, quant_ops, group=group_size)
    else:
        model.quant_report = None
    pack_linears(model, linear_backend)
    model.use_cpu_ops(ops)
    return model.eval()
