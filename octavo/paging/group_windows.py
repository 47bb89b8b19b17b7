"""The KV cache groups' geometry: each group's sliding window (None: full attention), which
block a query can still see, and the order groups register their blocks in. Shared, read-only,
by the KV manager, its prefix cache, its swap space and its audit."""

from __future__ import annotations

from collections.abc import Sequence


class GroupWindows:
    def __init__(self, windows: Sequence[int | None], block_size: int) -> None:
        if not windows or any(w is not None and w < 1 for w in windows):
            raise ValueError(f"windows must name >= 1 group, each window >= 1: {windows}")
        self.windows = tuple(windows)
        self.block_size = block_size
        self.num_groups = len(self.windows)
        self.has_window = any(w is not None for w in self.windows)
        # the first full-attention group: its chain keys vouch for the whole prefix, so the
        # sliding groups of a hybrid model chain onto it (None: every group slides)
        self.anchor = next((g for g, w in enumerate(self.windows) if w is None), None)
        # register the anchor first: the sliding groups' parent keys are its keys
        self.order = sorted(range(self.num_groups), key=lambda g: g != self.anchor)

    def first_live(self, group: int, pos: int) -> int:
        """The first block a query at `pos` or later can still see in `group`."""
        window = self.windows[group]
        if window is None:
            return 0
        return max(0, pos - window + 1) // self.block_size
