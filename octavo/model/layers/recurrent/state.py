"""The recurrent layers' state slots on the device (and the host, for swap), and what one step
tells the recurrent layers: which slot each sequence reads and writes.

A slot holds, for every recurrent layer, its state tensors (a convolution window and the
recurrent state proper); the KV manager's state-slot pool (paging/state_slots.py) hands the
slots out, and the plan's transfers move them. Tensors are [num_slots, *shape] per layer and
state, so a slot is row `s` of each. Recurrent states stay in float32 whatever the model's
dtype (transformers keeps them so); the convolution windows take the model's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# per recurrent layer, its state tensors' (shape, dtype)
StateShapes = list[list[tuple[tuple[int, ...], torch.dtype]]]


@dataclass(slots=True)
class StateChunk:
    """A prefill chunk's rows of the flat batch, for the recurrent layers."""

    query_start: int
    query_end: int
    slot: int  # the sequence's state slot: read (unless start_pos is 0) and written
    start_pos: int  # 0: the chunk starts from the zero state
    # (tokens into the chunk, slot): the state after that many of the chunk's tokens is also
    # written into that slot (a prefix-cache snapshot at a block boundary)
    snapshot: tuple[int, int] | None = None


@dataclass(slots=True)
class StateMetadata:
    """The state group's metadata of a step: decodes first (one token each), then chunks."""

    num_decodes: int
    decode_slots: torch.Tensor  # [num_decodes] long, on the device
    # decode rows whose sequence starts here (position 0): their slot is zeroed first
    fresh_slots: list[int]
    prefills: list[StateChunk]


class StateCache:
    def __init__(self, shapes: StateShapes, num_slots: int, device: torch.device,
                 num_host_slots: int = 0) -> None:
        self.shapes = shapes
        self.num_slots = num_slots
        self.device_states = [[torch.zeros((num_slots, *shape), dtype=dtype, device=device)
                               for shape, dtype in layer] for layer in shapes]
        pin = device.type == "cuda"
        self.host_states = [[torch.zeros((num_host_slots, *shape), dtype=dtype, pin_memory=pin)
                             for shape, dtype in layer] for layer in shapes]

    def layer(self, j: int) -> list[torch.Tensor]:
        """Recurrent layer j's state tensors, [num_slots, *shape] each."""
        return self.device_states[j]

    def run(self, transfers: list[tuple[str, int, int]]) -> None:
        """The plan's transfers, one after the other in their order (a slot one reads may be
        written by a later one)."""
        for kind, src, dst in transfers:
            pairs = zip(self.device_states, self.host_states, strict=True)
            for device_layer, host_layer in pairs:
                for d, h in zip(device_layer, host_layer, strict=True):
                    if kind == "copy":
                        d[dst].copy_(d[src])
                    elif kind == "out":
                        h[dst].copy_(d[src])
                    elif kind == "in":
                        d[dst].copy_(h[src])
                    else:
                        raise ValueError(f"unknown state transfer {kind!r}")

    @staticmethod
    def bytes_per_slot(shapes: StateShapes) -> int:
        total = 0
        for layer in shapes:
            for shape, dtype in layer:
                total += torch.empty((), dtype=dtype).element_size() * int(
                    torch.Size(shape).numel())
        return total
