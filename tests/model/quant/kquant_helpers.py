"""Helpers shared by the K-quant tests (test_kquant*.py): the kinds and their test ids, gguf-py's
dequantization (the independent reference) and the check of a kernel's output against W times
the float activations and W times the activations as the kernel quantized them."""

from __future__ import annotations

import numpy as np
import torch

from octavo.model.quant import kquant
from tests.model.quant.kquant_blocks import GGML_NAMES

KINDS = list(GGML_NAMES)
IDS = [GGML_NAMES[k] for k in KINDS]


def gguf_dequantize(kind: int, raw: np.ndarray) -> torch.Tensor:
    import gguf.quants
    from gguf import GGMLQuantizationType

    w = gguf.quants.dequantize(raw, GGMLQuantizationType[GGML_NAMES[kind]])
    return torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32))


def check_against_references(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor,
                             bias: torch.Tensor | None) -> None:
    got, w64 = got.double(), w.double()
    b = 0 if bias is None else bias.double()
    xq, d = kquant.quantize_activations(x)
    m, k = x.shape
    x_as = (xq.double().reshape(m, -1, 256) * d.double()[..., None]).reshape(m, k)
    # the quantized activations: fp32 rounding only
    mag = x_as.abs() @ w64.abs().T
    assert ((got - (x_as @ w64.T + b)).abs() <= 1e-5 * mag + 1e-9).all()
    # the float activations: the int8 rounding's bound (plus the fp32 slack above)
    half_step = (d.double() / 2).repeat_interleave(256, dim=1)
    bound = half_step @ w64.abs().T
    err = (got - (x.double() @ w64.T + b)).abs()
    assert (err <= bound + 1e-5 * mag + 1e-9).all(), (err - bound).max()
    assert err.max() > 0  # the activations were rounded: the two references differ
