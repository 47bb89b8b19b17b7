"""Key smoothing for quantized KV pages (`kv_smooth_keys`): keys centred and rotated before
they are quantized, queries rotated alike, so that attention computes what it computed before
but for the rounding of the stored values.

A few key channels of some models are far larger than the rest: Qwen2.5's K projection has a
bias, and its first layers' keys reach |k| ~ 350 in channels that vary by ~10 from token to
token. One int8 scale per token (or one fp8 scale per head) is then set by those channels, and
every other channel keeps a few levels. Two changes take them out, each exact before rounding:

- centring: the page stores k - m, with m one vector per layer and KV head (the keys' mean over
  the calibration prompt, kv_calibration.py). Every score of one query moves by the same q.m,
  which the softmax ignores (SageAttention's "smooth K"). A soft cap (tanh(s / c) * c) is not
  shift invariant, so soft-capped layers are only rotated.
- rotation: k H and q H with H the normalised Hadamard matrix of head_dim (a power of two;
  other head sizes are only centred). H is orthonormal, so q.k is unchanged, and it spreads one
  large channel over all of them (QuaRot's rotation), which fp8's per-element rounding needs.

Values are rotated by the same H (not centred: that measured worse): the output is a weighted
sum of them, so it comes out rotated and is turned back by H once per query row. int8's
per-token scale then sees values whose size is spread over the row as well.
All of it happens in the attention layer around the backend call, so every attention path
(C++, torch, Triton, the C++ decode loop) reads the pages unchanged.
"""

from __future__ import annotations

import torch


def hadamard(n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The normalised Sylvester-Hadamard matrix of order n (a power of two): symmetric and
    orthonormal (H @ H == I)."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"a Hadamard rotation needs a power-of-two head size, not {n}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / n**0.5).to(dtype)


def rotatable(head_dim: int) -> bool:
    return head_dim > 1 and not head_dim & (head_dim - 1)


def smooth_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_offset: torch.Tensor | None,
               rotation: torch.Tensor | None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [T, heads, head_dim], k and v [T, kv_heads, head_dim] -> (q H, (k - m) H, v H), in
    their own dtypes (computed in fp32, or in their own dtype if wider). `k_offset` m:
    [kv_heads, head_dim]; `rotation` H: [head_dim, head_dim]; either may be None. Attention
    over these gives the output rotated by H: `unrotate` it."""
    if k_offset is None and rotation is None:
        return q, k, v
    work = torch.promote_types(k.dtype, torch.float32)
    kf = k.to(work)
    if k_offset is not None:
        kf = kf - k_offset.to(work)
    if rotation is not None:
        h = rotation.to(work)
        kf = kf @ h
        q = (q.to(work) @ h).to(q.dtype)
        v = (v.to(work) @ h).to(v.dtype)
    return q, kf.to(k.dtype), v


def unrotate(o: torch.Tensor, rotation: torch.Tensor | None) -> torch.Tensor:
    """Attention's output over rotated values [T, heads, head_dim] -> the output (o H^T = o H:
    the normalised Hadamard matrix is symmetric)."""
    if rotation is None:
        return o
    work = torch.promote_types(o.dtype, torch.float32)
    return (o.to(work) @ rotation.to(work)).to(o.dtype)
