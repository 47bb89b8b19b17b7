"""Reading an HF checkpoint's tensors into a model's parameters, for the families whose layers
are not Llama's (LlamaForCausalLM.load_hf_state_dict keeps its own, older copy of the same):
`take(name)` a checkpoint tensor, `put(name, tensor)` into a parameter of the same shape, and
`finish()` fails on any parameter left unset."""

from __future__ import annotations

import torch
from torch import nn


class CheckpointLoader:
    def __init__(self, model: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
        self.own = dict(model.named_parameters())
        self.tensors = tensors
        self.loaded: set[str] = set()

    def take(self, name: str) -> torch.Tensor:
        if name not in self.tensors:
            raise ValueError(f"checkpoint is missing tensor {name!r}")
        return self.tensors[name]

    def put(self, name: str, value: torch.Tensor) -> None:
        param = self.own.get(name)
        if param is None:
            raise ValueError(f"checkpoint tensor maps to unknown parameter {name!r}")
        if param.shape != value.shape:
            raise ValueError(f"checkpoint tensor for {name!r} has shape {tuple(value.shape)}, "
                             f"expected {tuple(param.shape)}")
        with torch.no_grad():
            param.copy_(value)
        self.loaded.add(name)

    def copy(self, src: str, dst: str) -> None:
        self.put(dst, self.take(src))

    def finish(self) -> None:
        missing = set(self.own) - self.loaded
        if missing:
            raise ValueError(f"checkpoint left parameters unset: {sorted(missing)[:5]}")
