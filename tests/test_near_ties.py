"""The rule GPU tests compare greedy tokens by (tests/near_ties.py): equal, or equal up to a
position where HF's own top-2 gap is a recorded near-tie, with the chosen tokens' logprobs
within the stated bound until then; on CPU, equal."""

from __future__ import annotations

import pytest

from tests.near_ties import LOGPROB_ATOL, NEAR_TIE, HFReference, check_greedy

REF = HFReference(tokens=[[5, 6, 7, 8]], gaps=[[0.5, NEAR_TIE / 10, 0.5, 0.5]],
                  logprobs=[[-0.1, -0.7, -0.2, -0.3]])


def test_a_divergence_at_a_near_tie_is_recorded() -> None:
    assert check_greedy([[5, 6, 7, 8]], REF, exact=True) == []
    ties = check_greedy([[5, 9, 1, 1]], REF, exact=False,
                        got_logprobs=[[-0.1, -0.7, -5.0, -5.0]])  # logprobs after: free
    assert ties == [(0, 1, NEAR_TIE / 10)]


def test_anything_else_fails() -> None:
    with pytest.raises(AssertionError, match="token 1 is 9, HF 6"):
        check_greedy([[5, 9, 7, 8]], REF, exact=True)
    with pytest.raises(AssertionError, match="top-2 gap there is 5.00e-01"):
        check_greedy([[5, 6, 9, 8]], REF, exact=False)
    with pytest.raises(AssertionError, match="logprob is"):
        check_greedy([[5, 6, 7, 8]], REF, exact=False,
                     got_logprobs=[[-0.1, -0.7 + 2 * LOGPROB_ATOL, -0.2, -0.3]])
    with pytest.raises(AssertionError, match="3 tokens, HF 4"):
        check_greedy([[5, 6, 7]], REF, exact=False)
