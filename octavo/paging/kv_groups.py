"""KV cache groups: which layers share a block table (the hybrid KV cache, as in vLLM v1).

Layers that attend the same way (full attention, or a sliding window of the same width) keep
the same blocks, so they can share one block table. Where a model mixes them (Gemma 2 and 3
interleave local and global layers) the block pool stays one pool of equal blocks and the
layers are cut into groups of equal size, `slots_per_group` layers each, every group with its
own block table: a block id belongs to one group at a time and holds K/V for that group's
layers only. The KV tensors therefore have `slots_per_group` layer slots, not one per layer;
layer `l` lives in slot `layer_slot[l]` of whatever block its group `layer_group[l]` points at.

Gemma 3 270M (18 layers, every sixth global) becomes one full-attention group and five
sliding groups of three layers each; a model with one kind of layer (Llama, Mistral) is one
group of all its layers, which is the plain paged KV cache.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class KVGroups:
    windows: tuple[int | None, ...]  # per group: its sliding window, None for full attention
    layer_group: tuple[int, ...]  # per layer: its group
    layer_slot: tuple[int, ...]  # per layer: its slot in the KV tensors
    slots_per_group: int

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def has_window(self) -> bool:
        return any(w is not None for w in self.windows)

    def group_layers(self, group: int) -> list[int]:
        return [i for i, g in enumerate(self.layer_group) if g == group]

    @classmethod
    def single(cls, num_layers: int, window: int | None = None) -> KVGroups:
        return cls((window,), (0,) * num_layers, tuple(range(num_layers)), num_layers)

    @classmethod
    def from_layer_windows(cls, layer_windows: tuple[int | None, ...]) -> KVGroups:
        """Kinds of layers in order of first appearance; each kind cut into groups of the
        smallest kind's layer count (the last group of a kind may be smaller: its spare slots
        are simply unused)."""
        if not layer_windows:
            raise ValueError("a model needs at least one layer")
        kinds: dict[int | None, list[int]] = {}
        for layer, window in enumerate(layer_windows):
            if window is not None and window < 1:
                raise ValueError(f"layer {layer}: sliding window {window} must be >= 1")
            kinds.setdefault(window, []).append(layer)
        size = min(len(layers) for layers in kinds.values())
        windows: list[int | None] = []
        layer_group = [0] * len(layer_windows)
        layer_slot = [0] * len(layer_windows)
        for window, layers in kinds.items():
            for start in range(0, len(layers), size):
                for slot, layer in enumerate(layers[start : start + size]):
                    layer_group[layer] = len(windows)
                    layer_slot[layer] = slot
                windows.append(window)
        return cls(tuple(windows), tuple(layer_group), tuple(layer_slot), size)
