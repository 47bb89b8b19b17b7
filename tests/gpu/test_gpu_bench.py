"""`octavo bench gpu`'s decode comparison at a tiny size on the tests' device (tests/conftest.py:
in Triton's interpreter on CPU, compiled on CUDA): the paged kernel over shuffled blocks and the
contiguous SDPA baseline see the same keys."""

from __future__ import annotations

import torch

from octavo.bench.gpu import decode_point
from tests.conftest import ON_CUDA, TEST_DEVICE


def test_decode_point_compares_the_same_keys_both_ways() -> None:
    got = decode_point(3, 40, 8, 2, 64, dtype=torch.float32, device=str(TEST_DEVICE))
    assert got["max_abs_err"] < (1e-4 if ON_CUDA else 1e-5)  # CUDA's SDPA sums differently
    assert got["splits"] == 1 and got["paged_ms"] > 0 and got["contiguous_ms"] > 0
