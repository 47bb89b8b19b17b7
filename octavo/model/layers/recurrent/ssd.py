"""The Mamba-2 selective state space scan (state space duality), as transformers' torch paths
compute it (mamba2_chunk_scan for a chunk of tokens, mamba2_selective_state_update for one):

    S_t = S_{t-1} * exp(dt_t A) + dt_t x_t B_t^T;   y_t = S_t C_t + D x_t

per head, with a scalar decay A < 0, dt = clamp(softplus(dt_raw + dt_bias)) and B, C shared by
the heads of a group; state S [heads, head_dim, state_size] in float32. A prefill chunk runs the
chunked form (quadratic within chunks of CHUNK tokens, a scan over the chunks); decodes run the
recurrent step for a batch of sequences at once, in C++ on CPU (csrc/recurrent_step.cpp) where
the compiled ops are loaded.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

CHUNK = 64


def chunk_ssd(x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
              c: torch.Tensor, d: torch.Tensor, state: torch.Tensor | None
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence: x [T, H, P], dt [T, H] (discretized), a [H] (negative), b, c [T, H, N]
    (repeated to the heads), d [H]; state [H, P, N] float32 or None (zeros). Returns (outputs
    [T, H, P] in x's dtype, the state after the last token)."""
    dtype = x.dtype
    length, heads, head_dim = x.shape
    x, dt, b, c = (t.float() for t in (x, dt, b, c))
    skip = x * d.float()[:, None]
    pad = (CHUNK - length % CHUNK) % CHUNK
    xs = F.pad(x * dt[..., None], (0, 0, 0, 0, 0, pad))
    b, c = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (b, c))
    decay = F.pad(dt * a.float(), (0, 0, 0, pad))  # [T', H]
    chunks = (length + pad) // CHUNK
    xs, b, c = (t.reshape(chunks, CHUNK, heads, t.shape[-1]) for t in (xs, b, c))
    cum = decay.reshape(chunks, CHUNK, heads).permute(0, 2, 1).cumsum(dim=-1)  # [c, H, l]
    lower = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=x.device).tril()
    # exp(sum of the decays after s up to l), l >= s
    seg = (cum[..., :, None] - cum[..., None, :]).masked_fill(~lower, float("-inf")).exp()
    s = (torch.zeros(heads, head_dim, b.shape[-1], dtype=torch.float32, device=x.device)
         if state is None else state.float())
    out = torch.empty(chunks, CHUNK, heads, head_dim, dtype=torch.float32, device=x.device)
    for i in range(chunks):
        scores = torch.einsum("lhn,shn->hls", c[i], b[i]) * seg[i]
        diag = torch.einsum("hls,shp->lhp", scores, xs[i])
        off = torch.einsum("lhn,hpn->lhp", c[i], s) * cum[i].exp().t()[..., None]
        out[i] = diag + off
        tail = (cum[i, :, -1:] - cum[i]).exp().t()  # [l, H]: decay from l to the chunk's end
        s = (s * cum[i, :, -1].exp()[:, None, None]
             + torch.einsum("lhn,lhp->hpn", b[i] * tail[..., None], xs[i]))
    y = out.reshape(-1, heads, head_dim)[:length] + skip
    return y.to(dtype), s


def recurrent_ssd(x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                  c: torch.Tensor, d: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """One token of B sequences: x [B, H, P], dt [B, H] (discretized), b, c [B, H, N]; state
    [B, H, P, N] float32, updated in place. Returns the outputs [B, H, P] in x's dtype."""
    decay = torch.exp(dt.float() * a.float())[..., None, None]
    s = state * decay + (dt[..., None] * x)[..., None] * b[:, :, None, :]
    state.copy_(s)
    y = (s * c[:, :, None, :]).sum(dim=-1) + x * d[:, None]
    return y.to(x.dtype)


def ssd_decode(x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
               c: torch.Tensor, d: torch.Tensor, states: torch.Tensor, slots: torch.Tensor,
               ops: Any = None) -> torch.Tensor:
    """One token of B sequences: x [B, H, P], dt [B, H], b, c [B, G, N] per group (not yet
    repeated to the heads); each sequence reads and writes its state in place at row
    `slots[i]` of `states` [num_slots, H, P, N]. `ops`: the compiled CPU ops (None, or on
    another device: torch). Returns the outputs [B, H, P]."""
    step = getattr(ops, "ssd_step", None)
    if step is None or states.device.type != "cpu":
        rep = x.shape[1] // b.shape[1]
        state = states[slots]
        out = recurrent_ssd(x, dt, a, b.repeat_interleave(rep, dim=1),
                            c.repeat_interleave(rep, dim=1), d, state)
        states[slots] = state
        return out
    out = torch.empty(x.shape, dtype=torch.float32)
    step(*(t.float().contiguous() for t in (x, dt, a, b, c, d)), states, slots.contiguous(),
         out)
    return out.to(x.dtype)
