"""What a drafter needs of the runner's input batch (worker/input_batch.py's `InputBatch` is
the one implementation): each sequence's tokens so far, and the flattened inputs of a list of
rows. A protocol, so that drafting depends on no part of the worker."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import torch

from octavo.step_plan import SeqChunk


class HasTokens(Protocol):
    token_ids: Sequence[int]


class DraftBatch(Protocol):
    device: torch.device

    @property
    def seqs(self) -> Mapping[int, HasTokens]: ...

    def prepare(self, rows: list[SeqChunk]) -> Any:
        """The rows' model inputs: `input_ids`, `positions` and `metas`."""
        ...
