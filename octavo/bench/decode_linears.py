"""Decode-sized linear layers for `octavo bench cpu`: octavo's packed_gemv (csrc/packed_gemv.cpp)
against oneDNN on the same packed weights, for every linear layer of the model in order (all
its layers, so the weights come from memory as in a decode step: the four of each decoder layer
and the LM head), per ISA build of octavo's ops, per dtype, at 1 to 64 rows. The engine gives
packed_gemv the steps of up to `packed_gemv_max_rows(dtype, block)` rows; the rows above show
where oneDNN takes over. oneDNN picks its own ISA from the CPU, whichever build of octavo's runs
(in bf16 with AMX, its AMX kernels; packed_gemv's AMX kernel is then measured against its
vdpbf16ps one too)."""

from __future__ import annotations

import time

import torch
from torch import nn

from octavo.bench.common import median
from octavo.config import ModelConfig
from octavo.model.kernels.cpu_ops import load_cpu_ops
from octavo.model.layers.linear import PackedLinear, onednn_usable

ROWS = (1, 4, 8, 16, 24, 32, 64)


def layer_shapes(cfg: ModelConfig, layers: int) -> list[tuple[int, int]]:
    """(out, in) of every linear layer of a decode step, in order: qkv, o, gate_up, down per
    decoder layer, then the LM head."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    hidden, inter = cfg.hidden_size, cfg.intermediate_size
    per_layer = [(q + 2 * kv, hidden), (hidden, q), (2 * inter, hidden), (hidden, inter)]
    return per_layer * layers + [(cfg.vocab_size, hidden)]


def _packed(shapes: list[tuple[int, int]], dtype: torch.dtype) -> list[PackedLinear]:
    gen = torch.Generator().manual_seed(0)
    out = []
    for n, k in shapes:
        layer = nn.Linear(k, n, bias=False)
        with torch.no_grad():
            layer.weight.copy_(torch.randn(n, k, generator=gen) * k**-0.5)
        out.append(PackedLinear(layer.to(dtype)))
    return out


def _step_ms(layers: list[PackedLinear], xs: dict[int, torch.Tensor]) -> float:
    t = time.perf_counter()
    for layer in layers:
        layer(xs[layer.in_features])
    return 1e3 * (time.perf_counter() - t)


def _kernels(ops, packed: list[PackedLinear], dtype: torch.dtype) -> list[str]:
    """packed_gemv's kernels for these layers, the engine's first: where oneDNN packs bf16 for
    AMX (blocks of 32) and the CPU has it, AMX tiles and, as the A/B, vdpbf16ps."""
    if dtype == torch.float32:
        return ["fma"]
    if ops.packed_gemv_has_amx() and all(p.gemv_block == 32 for p in packed):
        return ["amx", "avx512_bf16"]
    return ["avx512_bf16"]


def _ab(packed: list[PackedLinear], shapes: list[tuple[int, int]], m: int, dtype: torch.dtype,
        repeats: int, gen: torch.Generator) -> tuple[float, float]:
    """(oneDNN, packed_gemv) medians of a step of `m` rows through every layer, interleaved."""
    xs = {k: torch.randn(m, k, generator=gen).to(dtype) for k in {s[1] for s in shapes}}
    times: dict[str, list[float]] = {"onednn": [], "packed_gemv": []}
    with torch.inference_mode():
        for rep in range(repeats + 1):
            for way in ("onednn", "packed_gemv"):
                for p in packed:
                    p.gemv_rows = 64 if way == "packed_gemv" else 0
                ms = _step_ms(packed, xs)
                if rep:  # the first of each is a warm-up
                    times[way].append(ms)
    return median(times["onednn"]), median(times["packed_gemv"])


def decode_linear_rows(cfg: ModelConfig, isas: list[str], repeats: int,
                       layers: int | None = None) -> list[dict]:
    """ms of one step's linear layers at each row count, oneDNN and packed_gemv interleaved
    (medians of `repeats`, after a warm-up of each)."""
    shapes = layer_shapes(cfg, layers or cfg.num_layers)
    rows_out = []
    for dtype in (torch.float32, torch.bfloat16):
        builds = [(isa, load_cpu_ops(isa)) for isa in isas]
        builds = [(isa, ops) for isa, ops in builds
                  if ops is not None and ops.packed_gemv_supports(dtype)]
        if not builds or not onednn_usable(dtype):
            continue
        packed = _packed(shapes, dtype)
        gen = torch.Generator().manual_seed(1)
        for isa, ops in builds:
            if not all(p.use_gemv(ops) for p in packed):
                continue  # a layout packed_gemv does not read: the engine keeps oneDNN
            engine_rows = ops.packed_gemv_max_rows(dtype, packed[0].gemv_block)
            kernels = _kernels(ops, packed, dtype)
            for kernel in kernels:
                amx_was = ops.packed_gemv_set_amx(kernel == "amx")
                try:
                    for m in ROWS:
                        one, gemv = _ab(packed, shapes, m, dtype, repeats, gen)
                        rows_out.append({"isa": isa, "dtype": str(dtype).removeprefix("torch."),
                                         "kernel": kernel, "rows": m, "onednn_ms": one,
                                         "packed_gemv_ms": gemv, "x_onednn": one / gemv,
                                         "engine_takes": m <= engine_rows
                                         and kernel == kernels[0]})
                finally:
                    ops.packed_gemv_set_amx(amx_was)
        del packed
    return rows_out
