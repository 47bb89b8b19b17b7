"""Reading an HF checkpoint's tensors into a model's parameters, for the families whose layers
are not Llama's (LlamaForCausalLM.load_hf_state_dict keeps its own, older copy of the same):
`take(name)` a checkpoint tensor, `put(name, tensor)` into a parameter of the same shape, and
`finish()` fails on any parameter left unset. Checkpoint tensors may be lazy (layers/weights.py):
fuse them with its `cat`, and `put` reads them as it copies."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from octavo.model.layers.weights import Lazy, Value, copy_into


class CheckpointLoader:
    def __init__(self, model: nn.Module, tensors: Mapping[str, Value]) -> None:
        self.own = dict(model.named_parameters())
        self.tensors = tensors
        self.loaded: set[str] = set()

    def take(self, name: str) -> Value:
        if name not in self.tensors:
            raise ValueError(f"checkpoint is missing tensor {name!r}")
        return self.tensors[name]

    def tensor(self, name: str) -> torch.Tensor:
        """A checkpoint tensor read whole, for a reshape before `put`."""
        value = self.take(name)
        return value.materialize() if isinstance(value, Lazy) else value

    def put(self, name: str, value: Value) -> None:
        param = self.own.get(name)
        if param is None:
            raise ValueError(f"checkpoint tensor maps to unknown parameter {name!r}")
        if param.shape != value.shape:
            raise ValueError(f"checkpoint tensor for {name!r} has shape {tuple(value.shape)}, "
                             f"expected {tuple(param.shape)}")
        with torch.no_grad():
            copy_into(param, value)
        self.loaded.add(name)

    def copy(self, src: str, dst: str) -> None:
        self.put(dst, self.take(src))

    def finish(self) -> None:
        missing = set(self.own) - self.loaded
        if missing:
            raise ValueError(f"checkpoint left parameters unset: {sorted(missing)[:5]}")
