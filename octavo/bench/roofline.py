"""The GEMM floor of a workload: how fast any engine could finish it if it did nothing but the
model's matrix multiplications, at the best rate this machine's CPU reaches on them.

A decoder-only model's linear layers do 2 FLOPs per weight per token they process, whatever the
engine: every prompt token and every generated token but the last passes through every layer,
and the vocabulary projection runs once per generated token (engines that project only the
sampled rows, as octavo and vLLM do). That work is timed here with oneDNN's pre-packed matmul
(octavo's CPU linear, and what vLLM's CPU build uses) at a decode-sized and a prefill-sized
batch; attention, norms, sampling and scheduling come on top. An engine's time divided by the
floor says how much room is left beside the matmuls.

The floor's passes reuse one layer's weights (with the vocabulary projection's at decode size),
so that layer's weights stay in the CPU's caches. `own_weights_s` times the same FLOPs over as
many sets of weights as the model has layers, each read from memory as in a real step: what
oneDNN reaches on the model itself. On a 2-vCPU Intel Xeon its decode rate was 4-7% lower
than the floor's at one thread and 12-15% lower at two, its prefill rate within 5%. The floor
stays the stricter reference.
"""

from __future__ import annotations

import time

import torch

from octavo.bench.common import median
from octavo.bench.workloads import Workload
from octavo.config import ModelConfig

DECODE_ROWS = 32  # a decode step of the throughput workloads
PREFILL_ROWS = 512  # a slice of a packed prefill step


def layer_shapes(cfg: ModelConfig) -> list[tuple[int, int]]:
    """(in, out) of one decoder layer's linear layers, q/k/v and gate/up fused."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    h, i = cfg.hidden_size, cfg.intermediate_size
    return [(h, q + 2 * kv), (q, h), (h, 2 * i), (i, h)]


def workload_flops(cfg: ModelConfig, wl: Workload) -> dict[str, float]:
    per_token = 2 * cfg.num_layers * sum(a * b for a, b in layer_shapes(cfg))
    prompt = sum(len(r.prompt_token_ids) for r in wl.requests)
    fed_back = sum(r.output_len - 1 for r in wl.requests)  # generated tokens run through layers
    return {
        "prefill_flops": prompt * per_token,
        "decode_flops": fed_back * per_token,
        "lm_head_flops": wl.output_tokens * 2 * cfg.hidden_size * cfg.vocab_size,
    }


def gemm_rate(cfg: ModelConfig, dtype: torch.dtype, rows: int, repeats: int = 5,
              copies: int = 1) -> float:
    """FLOP/s of a decoder layer's linears (plus the vocabulary projection at decode size),
    oneDNN-packed, at `rows` tokens; median of `repeats`. `copies` distinct sets of the layer's
    weights run one after another (the model's layer count: each read from memory as in a real
    step; 1: the same weights each time, hot in the caches)."""
    from octavo.model.layers.linear import PackedLinear, onednn_usable

    if copies < 1:
        raise ValueError(f"copies must be >= 1, got {copies}")
    shapes = layer_shapes(cfg) * copies + (
        [(cfg.hidden_size, cfg.vocab_size)] if rows <= 64 else [])
    layers = []
    for a, b in shapes:
        lin = torch.nn.Linear(a, b, bias=False).to(dtype)
        layers.append((PackedLinear(lin) if onednn_usable(dtype) else lin, a))
    flops = sum(2 * rows * a * layer.out_features for layer, a in layers)
    xs = {a: torch.randn(rows, a).to(dtype) for _, a in layers}
    times = []
    with torch.inference_mode():
        for rep in range(repeats + 1):
            t0 = time.perf_counter()
            for layer, a in layers:
                layer(xs[a])
            if rep:  # the first pass warms up
                times.append(time.perf_counter() - t0)
    return flops / median(times)


def gemm_rates(cfg: ModelConfig, dtype: torch.dtype) -> dict[str, float]:
    """GFLOP/s at the decode and prefill sizes, weights hot (the floor's) and each layer's own
    (`_own_weights`). They do not depend on the workload: measure once, price every workload."""
    rates: dict[str, float] = {}
    for suffix, copies in (("", 1), ("_own_weights", cfg.num_layers)):
        rates[f"decode_gflops{suffix}"] = gemm_rate(cfg, dtype, DECODE_ROWS, copies=copies) / 1e9
        rates[f"prefill_gflops{suffix}"] = gemm_rate(cfg, dtype, PREFILL_ROWS,
                                                     copies=copies) / 1e9
    return rates


def floor_seconds(cfg: ModelConfig, wl: Workload, dtype: torch.dtype,
                  rates: dict[str, float] | None = None) -> dict[str, float]:
    """The floor (`floor_s`, weights hot) and the same matmuls on each layer's own weights
    (`own_weights_s`), with the rates behind them in GFLOP/s (`rates`: from gemm_rates, None
    to measure them now)."""
    f = workload_flops(cfg, wl)
    rates = gemm_rates(cfg, dtype) if rates is None else rates
    out: dict[str, float] = {**f, **rates}
    for suffix, key in (("", "floor_s"), ("_own_weights", "own_weights_s")):
        out[key] = (f["prefill_flops"] / (rates[f"prefill_gflops{suffix}"] * 1e9)
                    + (f["decode_flops"] + f["lm_head_flops"])
                    / (rates[f"decode_gflops{suffix}"] * 1e9))
    return out
