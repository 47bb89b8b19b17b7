"""oneDNN pre-packed linears: same results as F.linear, and the switches that turn them off."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from octavo.model.layers.linear import PackedLinear, onednn_usable, pack_linears

needs_onednn = pytest.mark.skipif(not onednn_usable(torch.float32), reason="no oneDNN here")


class TwoLayers(nn.Module):
    def __init__(self, bias: bool) -> None:
        super().__init__()
        self.up = nn.Linear(64, 96, bias=bias)
        self.inner = nn.Sequential(nn.Linear(96, 32, bias=bias))

    def forward(self, x):
        return self.inner(F.relu(self.up(x)))


@needs_onednn
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_packed_matches_f_linear_fp32(bias, rows):
    torch.manual_seed(0)
    model = TwoLayers(bias).eval()
    x = torch.randn(rows, 64)
    with torch.inference_mode():
        want = model(x)
        assert pack_linears(model) == 2
        assert isinstance(model.up, PackedLinear) and isinstance(model.inner[0], PackedLinear)
        got = model(x)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not onednn_usable(torch.bfloat16), reason="no oneDNN bf16 here")
def test_packed_matches_f_linear_bf16():
    torch.manual_seed(1)
    model = TwoLayers(True).to(torch.bfloat16).eval()
    x = torch.randn(5, 64).to(torch.bfloat16)
    with torch.inference_mode():
        want = model(x).float()
        assert pack_linears(model) == 2
        got = model(x).float()
    torch.testing.assert_close(got, want, atol=5e-2, rtol=5e-2)


def test_torch_backend_leaves_layers_alone(monkeypatch):
    model = TwoLayers(False)
    assert pack_linears(model, "torch") == 0
    assert type(model.up) is nn.Linear


def test_bad_backend_name_is_refused():
    with pytest.raises(ValueError, match="linear backend 'mkl' is not one of"):
        pack_linears(TwoLayers(False), "mkl")


def test_onednn_required_but_unusable_dtype_is_an_error():
    model = TwoLayers(False).to(torch.float64)
    with pytest.raises(ValueError, match="cannot serve torch.float64"):
        pack_linears(model, "onednn")
    assert pack_linears(model) == 0  # auto: quietly keeps F.linear
