"""`octavo bench gpu`'s decode comparison, run on CPU in Triton's interpreter at a tiny size:
the paged kernel over shuffled blocks and the contiguous SDPA baseline see the same keys."""

from __future__ import annotations

import torch

from octavo.bench.gpu import decode_point


def test_decode_point_compares_the_same_keys_both_ways() -> None:
    got = decode_point(3, 40, 8, 2, 64, dtype=torch.float32, device="cpu")
    assert got["max_abs_err"] < 1e-5
    assert got["splits"] == 1 and got["paged_ms"] > 0 and got["contiguous_ms"] > 0
