"""The gated delta rule (Gated DeltaNet, Qwen3.5 and Qwen3-Next's linear attention), in
transformers' op order (torch_chunk_gated_delta_rule, torch_recurrent_gated_delta_rule):

    S_t = S_{t-1} * exp(g_t);  S_t += k_t (beta_t (v_t - S_t^T k_t))^T;  o_t = S_t^T q_t

with q and k L2-normed and q scaled by d_k^-0.5, state S [heads, d_k, d_v] in float32. A
prefill chunk runs the chunked form (a UT transform per chunk of 64 tokens, then a scan over
the chunks); decodes run the recurrent step for a batch of sequences at once, in C++ on CPU
(csrc/recurrent_step.cpp) where the compiled ops are loaded.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

CHUNK = 64


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def chunk_gated_delta(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                      beta: torch.Tensor, state: torch.Tensor | None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence: q, k [T, H, dk], v [T, H, dv], g, beta [T, H] (value heads: q and k
    already repeated to them), state [H, dk, dv] float32 or None (zeros). Returns (outputs
    [T, H, dv] in v's dtype, the state after the last token)."""
    dtype = q.dtype
    length, heads, dk = k.shape
    dv = v.shape[-1]
    q, k, v, beta, g = (t.transpose(0, 1).to(torch.float32, memory_format=torch.contiguous_format)
                        for t in (q, k, v, beta, g))
    q, k = l2norm(q), l2norm(k)
    q = q * q.shape[-1] ** -0.5
    pad = (CHUNK - length % CHUNK) % CHUNK
    q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
    beta, g = F.pad(beta, (0, pad)), F.pad(g, (0, pad))
    chunks = (length + pad) // CHUNK
    v_beta = v * beta.unsqueeze(-1)
    k_beta = k * beta.unsqueeze(-1)
    q, k, k_beta, v_beta = (t.reshape(heads, chunks, CHUNK, t.shape[-1])
                            for t in (q, k, k_beta, v_beta))
    g = g.reshape(heads, chunks, CHUNK)
    upper = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).triu(1)
    cum = g.cumsum(dim=2)
    decay = (cum.unsqueeze(3) - cum.unsqueeze(2)).masked_fill(upper, float("-inf")).exp()
    system = (k_beta @ k.transpose(-1, -2)) * decay
    intra = (q @ k.transpose(-1, -2)) * decay
    decayed_k_beta = k_beta * cum.exp().unsqueeze(-1)
    new_values = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    k_cumdecay = torch.linalg.solve_triangular(system, decayed_k_beta, upper=False,
                                               unitriangular=True)
    s = (torch.zeros(heads, dk, dv, dtype=new_values.dtype, device=q.device) if state is None
         else state.to(new_values))
    out = torch.zeros_like(new_values)
    q = q * cum.exp().unsqueeze(-1)
    k = k * (cum[..., -1:] - cum).exp().unsqueeze(-1)
    chunk_decay = cum[..., -1].exp()[..., None, None]
    for i in range(chunks):
        v_new = new_values[:, i] - k_cumdecay[:, i] @ s
        out[:, i] = q[:, i] @ s + intra[:, i] @ v_new
        s = s * chunk_decay[:, i] + k[:, i].transpose(-1, -2) @ v_new
    out = out.reshape(heads, -1, dv)[:, :length]
    return out.transpose(0, 1).to(dtype, memory_format=torch.contiguous_format), s


def recurrent_gated_delta(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                          beta: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """One token of B sequences: q, k [B, H, dk], v [B, H, dv], g, beta [B, H]; state
    [B, H, dk, dv] float32, updated in place. Returns the outputs [B, H, dv] in v's dtype."""
    dtype = q.dtype
    q, k, v, beta, g = (t.to(torch.float32) for t in (q, k, v, beta, g))
    q, k = l2norm(q), l2norm(k)
    q = q / (q.shape[-1] ** 0.5)
    s = state * g.exp()[..., None, None]
    kv_mem = (s * k.unsqueeze(-1)).sum(dim=-2)
    delta = (v - kv_mem) * beta.unsqueeze(-1)
    s = s + k.unsqueeze(-1) * delta.unsqueeze(-2)
    state.copy_(s)
    return (s * q.unsqueeze(-1)).sum(dim=-2).to(dtype)


def gated_delta_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                       beta: torch.Tensor, states: torch.Tensor, slots: torch.Tensor,
                       ops: Any = None) -> torch.Tensor:
    """One token of B sequences (shapes as recurrent_gated_delta's), each reading and writing
    its state in place at row `slots[i]` of `states` [num_slots, H, dk, dv]. `ops`: the compiled
    CPU ops (None, or on another device: torch). Returns the outputs [B, H, dv]."""
    step = getattr(ops, "gated_delta_step", None)
    if step is None or states.device.type != "cpu":
        state = states[slots]
        out = recurrent_gated_delta(q, k, v, g, beta, state)
        states[slots] = state
        return out
    out = torch.empty(v.shape, dtype=torch.float32)
    step(*(t.float().contiguous() for t in (q, k, v, g, beta)), states, slots.contiguous(), out)
    return out.to(v.dtype)
