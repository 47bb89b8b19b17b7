"""The compiled decode steps of the recurrent layers (csrc/recurrent_step.cpp) equal the torch
steps they replace (layers/recurrent/gated_delta.py, ssd.py): the outputs, and each sequence's
state updated in its own slot and nowhere else, for one sequence and for a batch; bad slots are
refused by name."""

from __future__ import annotations

import pytest
import torch

from octavo.model.kernels.cpu_ops import load_cpu_ops
from octavo.model.layers.recurrent.gated_delta import gated_delta_decode
from octavo.model.layers.recurrent.ssd import ssd_decode

ops = load_cpu_ops()
pytestmark = pytest.mark.skipif(ops is None, reason="compiled CPU ops unavailable")
TOL = dict(atol=1e-5, rtol=1e-5)  # the summation order differs


def _states(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    return torch.randn(6, *shape, generator=gen)


@pytest.mark.parametrize("slots", [[4], [5, 0, 2]])
def test_gated_delta_step(slots) -> None:
    gen = torch.Generator().manual_seed(len(slots))
    b, h, dk, dv = len(slots), 4, 16, 8
    q, k = (torch.randn(b, h, dk, generator=gen) for _ in range(2))
    v = torch.randn(b, h, dv, generator=gen)
    g = -torch.rand(b, h, generator=gen)
    beta = torch.rand(b, h, generator=gen)
    states = _states((h, dk, dv), gen)
    index = torch.tensor(slots)
    want_states = states.clone()
    want = gated_delta_decode(q, k, v, g, beta, want_states, index)
    got = gated_delta_decode(q, k, v, g, beta, states, index, ops)
    torch.testing.assert_close(got, want, **TOL)
    torch.testing.assert_close(states, want_states, **TOL)


@pytest.mark.parametrize("slots", [[1], [3, 5, 0, 2]])
def test_ssd_step(slots) -> None:
    gen = torch.Generator().manual_seed(len(slots))
    bsz, h, p, groups, n = len(slots), 8, 16, 2, 16
    x = torch.randn(bsz, h, p, generator=gen)
    dt = torch.rand(bsz, h, generator=gen)
    a = -torch.rand(h, generator=gen)
    b, c = (torch.randn(bsz, groups, n, generator=gen) for _ in range(2))
    d = torch.randn(h, generator=gen)
    states = _states((h, p, n), gen)
    index = torch.tensor(slots)
    want_states = states.clone()
    want = ssd_decode(x, dt, a, b, c, d, want_states, index)
    got = ssd_decode(x, dt, a, b, c, d, states, index, ops)
    torch.testing.assert_close(got, want, **TOL)
    torch.testing.assert_close(states, want_states, **TOL)


def test_a_slot_out_of_range_is_refused() -> None:
    x = torch.zeros(1, 2, 4)
    with pytest.raises(RuntimeError, match="state slot 9 out of range"):
        ops.ssd_step(x, torch.zeros(1, 2), torch.zeros(2), torch.zeros(1, 1, 4),
                     torch.zeros(1, 1, 4), torch.zeros(2), torch.zeros(3, 2, 4, 4),
                     torch.tensor([9]), torch.empty(1, 2, 4))
