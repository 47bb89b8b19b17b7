"""The sparse mixture-of-experts block (Qwen2-MoE, Mixtral) and the loading of its experts.

The experts' weights are stacked: `gate_up_proj` [E, 2 * I, H] (gate rows, then up rows, as in
octavo's fused MLP) and `down_proj` [E, H, I]; they are plain parameters, so pack_linears leaves
them alone. One forward pass, in transformers' `grouped_mm` op order (its default experts
implementation), so fp32 results agree bit for bit where the matmuls do:

1. router logits, softmax in fp32, top-k, optionally renormalised over the k;
2. the T * k (token, expert) pairs sorted by expert (one sort), each expert's end row found by
   a binary search in the sorted ids (on the device: nothing is read back to the host);
3. one grouped matmul for gate_up and one for down over the sorted rows (torch's grouped_mm
   where it runs for the device and dtype; otherwise one matmul per expert that has tokens, at
   most E iterations — never a loop over tokens);
4. each row scaled by its routing weight, unsorted, and the k rows of each token summed.

Qwen2-MoE adds a shared expert (a dense MLP) scaled by sigmoid(shared_expert_gate(x)).

Inside a CUDA graph nothing may wait for the host: the grouped path never does, while the
per-expert fallback reads the group sizes back once per block. `graph_safe` tells the runner,
once at start-up, whether a model's decode steps may be captured (cuda_graphs.py).
"""

from __future__ import annotations

import dataclasses
from functools import cache
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from octavo.config import ModelConfig
from octavo.model.layers.decoder import MLP
from octavo.model.layers.weights import Put, Take, cat, stack


@cache
def grouped_mm_usable(device_type: str, dtype: torch.dtype) -> bool:
    """Whether torch's grouped_mm runs here and agrees with a per-expert F.linear."""
    fn = getattr(F, "grouped_mm", None)
    if fn is None:
        return False
    try:
        gen = torch.Generator().manual_seed(0)
        w = torch.randn(3, 8, 16, generator=gen).to(device=device_type, dtype=dtype)
        x = torch.randn(5, 16, generator=gen).to(device=device_type, dtype=dtype)
        offs = torch.tensor([2, 2, 5], dtype=torch.int32, device=device_type)
        with torch.inference_mode():
            got = fn(x, w.transpose(-2, -1), offs=offs)
            want = torch.cat([F.linear(x[:2], w[0]), F.linear(x[2:], w[2])])
        return bool(torch.allclose(got.float(), want.float(), rtol=1e-2, atol=1e-2))
    except Exception:  # whatever a device or build without it raises: the fallback runs
        return False


def _expert_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """One expert's matmul over its rows (the fallback loop's body; tests count its calls)."""
    return F.linear(x, weight)


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor,
                   counts: list[int] | None, grouped: bool) -> torch.Tensor:
    """x [S, in] sorted by expert, weight [E, out, in], offsets [E] int32 cumulative counts:
    each group's rows times its expert's weight^T. `grouped`: one torch grouped_mm; else one
    matmul per expert with rows (counts: the group sizes, read once)."""
    if grouped:
        return F.grouped_mm(x, weight.transpose(-2, -1), offs=offsets)
    assert counts is not None
    out = x.new_empty(x.shape[0], weight.shape[1])
    start = 0
    for e, n in enumerate(counts):
        if n:
            out[start:start + n] = _expert_linear(x[start:start + n], weight[e])
            start += n
    return out


class SparseMoeBlock(nn.Module):
    """Top-k routed experts (+ an optional sigmoid-gated shared expert)."""

    def __init__(self, config: ModelConfig, num_experts: int, top_k: int, intermediate: int,
                 norm_topk_prob: bool, weights_in_model_dtype: bool,
                 shared_intermediate: int | None = None) -> None:
        super().__init__()
        if config.hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"{config.model_type}: hidden_act={config.hf['hidden_act']!r} is "
                             "not supported (only silu)")
        if not 0 < top_k <= num_experts:
            raise ValueError(f"{config.model_type}: num_experts_per_tok={top_k} must be in "
                             f"1..{num_experts}")
        h = config.hidden_size
        self.num_experts, self.top_k, self.intermediate = num_experts, top_k, intermediate
        self.norm_topk_prob = norm_topk_prob
        # Qwen2-MoE casts the routing weights to the model dtype before scaling the experts'
        # rows; Mixtral keeps them fp32 (the product then is fp32 until the final cast)
        self.weights_in_model_dtype = weights_in_model_dtype
        self.gate = nn.Linear(h, num_experts, bias=False)  # the router
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, h))
        self.down_proj = nn.Parameter(torch.empty(num_experts, h, intermediate))
        self.shared_expert: MLP | None = None
        self.shared_expert_gate: nn.Linear | None = None
        if shared_intermediate:
            shared_config = dataclasses.replace(config, intermediate_size=shared_intermediate,
                                                mlp_bias=False)
            self.shared_expert = MLP(shared_config)
            self.shared_expert_gate = nn.Linear(h, 1, bias=False)
        self.ops: Any = None  # compiled CPU ops, when enabled

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Routing weights and expert ids, both [T, top_k]."""
        logits = self.gate(x)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights /= weights.sum(dim=-1, keepdim=True)
        if self.weights_in_model_dtype:
            weights = weights.to(logits.dtype)
        return weights, ids

    def experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        tokens, hidden = x.shape
        flat_ids = ids.reshape(-1)  # [S], S = T * top_k, row j is token j // top_k
        sorted_ids, perm = torch.sort(flat_ids, stable=True)
        rows = x[perm // self.top_k]
        experts = torch.arange(self.num_experts, device=x.device, dtype=sorted_ids.dtype)
        # each expert's end row, cumulative (grouped_mm's offs), found on the device
        offsets = torch.searchsorted(sorted_ids, experts, right=True).to(torch.int32)
        grouped = grouped_mm_usable(x.device.type, x.dtype)
        # the one host sync of the fallback loop (never inside a graph: see graph_safe)
        counts = None if grouped else torch.diff(offsets, prepend=offsets[:1] * 0).tolist()
        h = grouped_linear(rows, self.gate_up_proj, offsets, counts, grouped)
        if self.ops is not None:
            h = self.ops.silu_and_mul(h.contiguous())
        else:
            gate, up = h.chunk(2, dim=-1)
            h = F.silu(gate) * up
        h = grouped_linear(h, self.down_proj, offsets, counts, grouped)
        h = h * weights.reshape(-1)[perm].unsqueeze(-1)
        unsorted = torch.empty_like(h)
        unsorted[perm] = h
        return unsorted.view(tokens, self.top_k, hidden).sum(dim=1).to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shared = self.shared_expert(x) if self.shared_expert is not None else None
        weights, ids = self.route(x)
        out = self.experts(x, weights, ids)
        if shared is not None:
            assert self.shared_expert_gate is not None
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * shared
        return out


def has_tensor(take: Take, name: str) -> bool:
    try:
        take(name)
    except ValueError:
        return False
    return True


def load_experts(src: str, dst: str, take: Take, put: Put, num_experts: int,
                 names: tuple[str, str, str]) -> None:
    """The experts of one block into its stacked parameters. src: the checkpoint's block
    prefix; names: the per-expert (gate, up, down) projections (Qwen2-MoE: gate_proj, up_proj,
    down_proj; Mixtral: w1, w3, w2). Checkpoints already stacked (transformers' in-memory
    layout: experts.gate_up_proj [E, 2I, H], experts.down_proj [E, H, I]) load as they are."""
    if has_tensor(take, f"{src}experts.gate_up_proj"):
        put(f"{dst}gate_up_proj", take(f"{src}experts.gate_up_proj"))
        put(f"{dst}down_proj", take(f"{src}experts.down_proj"))
        return
    gate, up, down = names
    gate_up = [cat([take(f"{src}experts.{e}.{gate}.weight"),
                    take(f"{src}experts.{e}.{up}.weight")]) for e in range(num_experts)]
    put(f"{dst}gate_up_proj", stack(gate_up))
    put(f"{dst}down_proj", stack([take(f"{src}experts.{e}.{down}.weight")
                                  for e in range(num_experts)]))


def graph_safe(model: nn.Module, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether `model`'s MoE blocks (if any) run without reading anything back to the host on
    `device` in `dtype`, as a CUDA graph needs: their experts go through grouped_mm there."""
    if not any(isinstance(m, SparseMoeBlock) for m in model.modules()):
        return True
    return grouped_mm_usable(device.type, dtype)


def set_moe_ops(model: nn.Module, ops: Any) -> None:
    for module in model.modules():
        if isinstance(module, SparseMoeBlock):
            module.ops = ops
