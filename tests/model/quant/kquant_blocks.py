"""K-quant super-blocks for tests: random valid ones (numpy), and a plain quantizer (gguf-py has
none for Q4_K / Q5_K / Q6_K) that turns fp32 weights into them, so that a tiny model keeps its
behaviour. The quantizer is simple (min/max per sub-block, not llama.cpp's search); what matters
here is that the bytes are valid super-blocks whose dequantization is close to the weights."""

from __future__ import annotations

import numpy as np
import torch

from octavo.model.quant import kquant

GGML_NAMES = {kquant.Q4_K: "Q4_K", kquant.Q5_K: "Q5_K", kquant.Q6_K: "Q6_K"}


def _f16(a: np.ndarray) -> np.ndarray:
    return a.astype(np.float16).view(np.uint8).reshape(*a.shape, 2)


def random_blocks(kind: int, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """kquant.random_blocks, seeded from `rng`, as numpy."""
    gen = torch.Generator().manual_seed(int(rng.integers(0, 2**31)))
    return kquant.random_blocks(kind, n, k, gen).numpy()


def _pack_scales_k4(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """8 six-bit scales and mins per block [..., 8] -> GGUF's 12 bytes [..., 12]."""
    sc, mn = sc.astype(np.uint8), mn.astype(np.uint8)
    out = np.zeros((*sc.shape[:-1], 12), np.uint8)
    out[..., 0:4] = (sc[..., :4] & 63) | ((sc[..., 4:] >> 4) << 6)
    out[..., 4:8] = (mn[..., :4] & 63) | ((mn[..., 4:] >> 4) << 6)
    out[..., 8:12] = (sc[..., 4:] & 15) | ((mn[..., 4:] & 15) << 4)
    return out


def quantize(kind: int, w: np.ndarray) -> np.ndarray:
    """fp32 [n, k] (k a multiple of 256) -> [n, k / 256 * bytes] super-blocks."""
    n, k = w.shape
    b = w.astype(np.float32).reshape(n * k // 256, 256)
    nb = b.shape[0]
    if kind == kquant.Q6_K:
        sub = b.reshape(nb, 16, 16)
        amax_i = np.abs(sub).argmax(-1)
        peak = np.take_along_axis(sub, amax_i[..., None], -1)[..., 0]
        scale = -peak / 32  # the largest |w| maps to code -32 (signed), as llama.cpp does
        d = (np.abs(scale).max(-1) / 127).astype(np.float16).astype(np.float32)
        inv_d = np.where(d > 0, 1 / np.where(d > 0, d, 1), 0)
        sc = np.clip(np.round(scale * inv_d[:, None]), -128, 127).astype(np.int8)
        step = d[:, None, None] * sc[..., None].astype(np.float32)
        q = np.where(step != 0, np.round(sub / np.where(step != 0, step, 1)), 0)
        q = (np.clip(q, -32, 31) + 32).astype(np.uint8).reshape(nb, 256)
        ql = np.zeros((nb, 128), np.uint8)
        qh = np.zeros((nb, 64), np.uint8)
        for h in range(2):
            g = q[:, 128 * h:128 * (h + 1)]
            ql[:, 64 * h:64 * h + 32] = (g[:, 0:32] & 15) | ((g[:, 64:96] & 15) << 4)
            ql[:, 64 * h + 32:64 * h + 64] = (g[:, 32:64] & 15) | ((g[:, 96:128] & 15) << 4)
            qh[:, 32 * h:32 * h + 32] = ((g[:, 0:32] >> 4) | ((g[:, 32:64] >> 4) << 2)
                                         | ((g[:, 64:96] >> 4) << 4) | ((g[:, 96:128] >> 4) << 6))
        out = np.concatenate([ql, qh, sc.view(np.uint8), _f16(d)], axis=1)
        return out.reshape(n, -1)
    levels = 15 if kind == kquant.Q4_K else 31
    sub = b.reshape(nb, 8, 32)
    lo = np.minimum(sub.min(-1), 0)
    scale = (sub.max(-1) - lo) / levels
    d = (scale.max(-1) / 63).astype(np.float16).astype(np.float32)
    dmin = (-lo.min(-1) / 63).astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(scale / np.where(d > 0, d, 1)[:, None]), 0, 63)
    mn = np.clip(np.round(-lo / np.where(dmin > 0, dmin, 1)[:, None]), 0, 63)
    step = (d[:, None] * sc)[..., None]
    offset = (dmin[:, None] * mn)[..., None]
    q = np.where(step > 0, np.round((sub + offset) / np.where(step > 0, step, 1)), 0)
    q = np.clip(q, 0, levels).astype(np.uint8).reshape(nb, 256)
    low = (q & 15).reshape(nb, 4, 2, 32)
    qs = low[:, :, 0] | (low[:, :, 1] << 4)
    parts = [_f16(d), _f16(dmin), _pack_scales_k4(sc, mn)]
    if kind == kquant.Q5_K:
        high = (q.reshape(nb, 8, 32) >> 4).astype(np.uint8)
        parts.append((high << np.arange(8, dtype=np.uint8)[None, :, None]).sum(1, dtype=np.uint8))
    parts.append(qs.reshape(nb, 128))
    return np.concatenate(parts, axis=1).reshape(n, -1)
