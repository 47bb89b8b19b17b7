"""The two callables a model's `_load_*` steps receive: `take(name)` reads a checkpoint tensor
(already cut to this rank's slice under tensor parallelism), `put(name, tensor)` copies it into
a parameter of the model."""

from __future__ import annotations

from collections.abc import Callable

import torch

Take = Callable[[str], torch.Tensor]
Put = Callable[[str, torch.Tensor], None]
