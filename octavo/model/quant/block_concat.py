"""A fused linear layer (q/k/v, gate/up) whose parts stay in blocks of different formats: a
Q4_K_M GGUF keeps v (and down) in Q6_K in some layers where q and k are Q4_K, so the fused qkv
of those layers has no single format. Each part computes in its own blocks and the outputs are
joined by columns, as the fused layer's would be."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from octavo.model.quant.block_quant import BlockQuantLinear


class BlockConcat(nn.Module):
    """y = [x W_1^T + b_1, x W_2^T + b_2, ...] with each W_i a `BlockQuantLinear`."""

    def __init__(self, parts: list[BlockQuantLinear]) -> None:
        super().__init__()
        if not parts or len({p.in_features for p in parts}) != 1:
            raise ValueError("the parts of a fused block layer must share their input features, "
                             f"not {[p.in_features for p in parts]}")
        self.parts = nn.ModuleList(parts)
        self.in_features = parts[0].in_features
        self.out_features = sum(p.out_features for p in parts)

    @property
    def ops(self) -> Any:
        return self.parts[0].ops

    @ops.setter
    def ops(self, ops: Any) -> None:
        for p in self.parts:
            p.ops = ops

    def nbytes(self) -> int:
        return sum(p.nbytes() for p in self.parts)

    def dequantized_weight(self) -> torch.Tensor:
        return torch.cat([p.dequantized_weight() for p in self.parts])

    def dequantize_rows(self, row_ids: torch.Tensor) -> torch.Tensor:
        ids = row_ids.reshape(-1).long()
        out = torch.empty(ids.numel(), self.in_features)
        start = 0
        for p in self.parts:
            mine = (ids >= start) & (ids < start + p.out_features)
            if mine.any():
                out[mine] = p.dequantize_rows(ids[mine] - start)
            start += p.out_features
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p(x) for p in self.parts], dim=-1)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                + " + ".join(p.fmt.name for p in self.parts))
