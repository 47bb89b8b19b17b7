"""The two callables a model's `_load_*` steps receive: `take(name)` reads a checkpoint tensor
(already cut to this rank's slice under tensor parallelism), `put(name, tensor)` copies it into
a parameter of the model."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

Take = Callable[[str], torch.Tensor]
Put = Callable[[str, torch.Tensor], None]


class Checkpoint(Protocol):
    """What the loaders read a checkpoint through: a dict of tensors (safetensors), or a GGUF
    file's tensors under their HF names (quant/gguf_tensors.py)."""

    def __contains__(self, name: object) -> bool: ...

    def __getitem__(self, name: str) -> torch.Tensor: ...
