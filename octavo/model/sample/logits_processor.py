"""Custom logits processors for offline users, in vLLM v1's shape.

A processor is a class, given to the engine once (`LLM(logits_processors=[MyProcessor])`, or
`--logits-processors pkg.module:MyProcessor`), built once by the runner as
`MyProcessor(engine_args, device, is_pin_memory)`, and called every step:

- `update_state(batch_update)` first, with what changed in the batch of rows that sample this
  step (None when nothing did): rows `added` as (index, SamplingParams, prompt token ids, output
  token ids), `removed` indices, `moved` pairs. Here an added row may take an index still in use
  (it replaces that row), and `moved` is always empty: every row whose sequence changed is
  added again. The output-token list of an added row is live: the runner appends to it as the
  sequence grows, so a processor may keep the reference. Per-request arguments arrive in
  `SamplingParams.extra_args`.
- `apply(logits)` with the [rows, vocab] float32 logits of the step, after logit_bias and the
  penalties, before the allowed-token masks (structured outputs, allowed_token_ids), bans and
  sampling; it returns the new logits (in place is fine).
- `is_argmax_invariant()`: True when the processor never changes which token is the argmax (it
  is then skipped for all-greedy batches, as vLLM does).
"""

from __future__ import annotations

import enum
import importlib
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from octavo.sampling_params import SamplingParams


class MoveDirectionality(enum.Enum):
    UNIDIRECTIONAL = enum.auto()  # a -> b, a is then empty
    SWAP = enum.auto()  # a <-> b


AddedRequest = tuple[int, SamplingParams, list[int] | None, list[int]]


@dataclass(frozen=True)
class BatchUpdate:
    batch_size: int
    removed: Sequence[int] = ()
    moved: Sequence[tuple[int, int, MoveDirectionality]] = ()
    added: Sequence[AddedRequest] = field(default_factory=tuple)


class LogitsProcessor(ABC):
    @abstractmethod
    def __init__(self, engine_args: Any, device: torch.device, is_pin_memory: bool) -> None:
        ...

    @abstractmethod
    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        ...

    @abstractmethod
    def is_argmax_invariant(self) -> bool:
        ...

    @abstractmethod
    def update_state(self, batch_update: BatchUpdate | None) -> None:
        ...


def resolve_processor_class(spec: Any) -> type[LogitsProcessor]:
    """A LogitsProcessor subclass, or its name as 'pkg.module:Class' or 'pkg.module.Class'."""
    cls = spec
    if isinstance(spec, str):
        module_name, sep, name = spec.partition(":")
        if not sep:
            module_name, _, name = spec.rpartition(".")
        try:
            cls = getattr(importlib.import_module(module_name), name)
        except (ImportError, AttributeError, ValueError) as e:
            raise ValueError(f"logits_processors: cannot import {spec!r}: {e}") from None
    if not (isinstance(cls, type) and issubclass(cls, LogitsProcessor)):
        raise ValueError(f"logits_processors: {spec!r} is not a subclass of "
                         "octavo.model.sample.logits_processor.LogitsProcessor")
    return cls


class LogitsProcessors:
    """The engine's processors and the row bookkeeping that feeds their update_state."""

    def __init__(self, specs: Iterable[Any], engine_args: Any, device: torch.device) -> None:
        self.processors = [resolve_processor_class(s)(engine_args, device, False)
                           for s in specs]
        self._rows: list[int] = []  # seq id of each row last step
        self._outputs: dict[int, list[int]] = {}  # seq id -> its live output token list

    def __bool__(self) -> bool:
        return bool(self.processors)

    def forget(self, seq_id: int) -> None:
        self._outputs.pop(seq_id, None)

    def update(self, seq_ids: list[int], params: list[SamplingParams],
               prompts: list[list[int]], outputs: list[list[int]]) -> None:
        """Tell the processors this step's rows (before apply)."""
        added: list[AddedRequest] = []
        for i, seq_id in enumerate(seq_ids):
            live = self._outputs.get(seq_id)
            fresh = live is None or len(live) != len(outputs[i])
            if fresh:
                live = self._outputs[seq_id] = list(outputs[i])
            if fresh or i >= len(self._rows) or self._rows[i] != seq_id:
                added.append((i, params[i], prompts[i], live))
        removed = list(range(len(seq_ids), len(self._rows)))
        self._rows = list(seq_ids)
        update = BatchUpdate(len(seq_ids), removed, (), tuple(added)) if (added or removed) \
            else None
        for p in self.processors:
            p.update_state(update)

    def record(self, seq_ids: list[int], tokens: list[int]) -> None:
        """The tokens sampled this step join the live output lists."""
        for seq_id, token in zip(seq_ids, tokens, strict=True):
            live = self._outputs.get(seq_id)
            if live is not None:
                live.append(token)

    def apply(self, logits: torch.Tensor, all_greedy: bool) -> torch.Tensor:
        for p in self.processors:
            if all_greedy and p.is_argmax_invariant():
                continue
            logits = p.apply(logits)
        return logits
