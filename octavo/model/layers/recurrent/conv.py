"""The short causal depthwise convolution in front of Gated DeltaNet and Mamba-2 scans, with its
window (the last kernel_size - 1 inputs) kept per sequence in the state slot. The same ops as
transformers' causal_conv1d_fn / causal_conv1d_update: a grouped conv1d over the window and
the new inputs, then the activation."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def conv_chunk(x: torch.Tensor, window: torch.Tensor | None, weight: torch.Tensor,
               bias: torch.Tensor | None, act) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's chunk: x [T, C], its window [C, K-1] (None: zeros, the sequence starts
    here), weight [C, K]. Returns (activated outputs [T, C], the inputs [C, K-1+T] the window
    and any later window are cut from)."""
    channels, kernel = weight.shape
    xt = x.t()
    if window is None:
        window = xt.new_zeros(channels, kernel - 1)
    full = torch.cat([window.to(xt.dtype), xt], dim=-1).to(weight.dtype)
    out = F.conv1d(full[None], weight[:, None, :], bias, groups=channels)[0]
    return act(out).to(x.dtype).t(), full


def conv_decode(x: torch.Tensor, windows: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None, act) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per sequence: x [B, C], windows [B, C, K-1]. Returns (activated outputs
    [B, C], the new windows [B, C, K-1])."""
    channels = weight.shape[0]
    full = torch.cat([windows.to(x.dtype), x[:, :, None]], dim=-1).to(weight.dtype)
    out = F.conv1d(full, weight[:, None, :], bias, groups=channels)[:, :, -1]
    return act(out).to(x.dtype), full[:, :, 1:]
