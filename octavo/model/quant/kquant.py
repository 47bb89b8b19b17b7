"""GGUF's K-quant super-blocks in torch: their layouts, their repacking at load, their
dequantization and the activations their kernels compute with. The compiled kernels
(csrc/kquant_linear.cpp) run on the same bytes; this is what a layer falls back to without them,
and the tests' reference.

A weight row is a run of super-blocks of 256 weights (a row of super-blocks is a row of weights,
so rows can be permuted and concatenated like any tensor's). In the file:
- Q4_K, 144 bytes: d, dmin (float16), 12 bytes packing eight 6-bit scales and eight 6-bit mins,
  128 bytes of nibbles (bytes 32j..32j+31: sub-block 2j in the low nibbles, 2j+1 in the high);
  w = d * scale_s * q - dmin * min_s over 8 sub-blocks of 32.
- Q5_K, 176 bytes: d, dmin, the 12 scale bytes, 32 bytes of fifth bits (bit s of byte l is
  sub-block s's element l), Q4_K's 128 bytes of nibbles.
- Q6_K, 210 bytes: 128 bytes of low nibbles, 64 bytes of 2-bit highs, 16 int8 scales (one per
  16 weights), d; w = d * scale_s * (q - 32).
In memory (`repack`), Q4_K and Q5_K have their 12 scale bytes unpacked into 8 scale bytes and 8
min bytes (148 and 180 bytes, 2.8% and 2.3% more): unpacking them took a third of the decode
kernel's instructions per super-block. Q6_K stays as the file has it. The dequantization is
gguf-py's (gguf.quants), bit for bit."""

from __future__ import annotations

import torch

Q4_K, Q5_K, Q6_K = 2, 3, 4  # kernel kinds (block_quant.py's INT4 = 0 and INT8 = 1 before them)
SUPER_BLOCK = 256
FILE_BYTES = {Q4_K: 144, Q5_K: 176, Q6_K: 210}  # a super-block in the GGUF file
BLOCK_BYTES = {Q4_K: 148, Q5_K: 180, Q6_K: 210}  # in memory (repack)


def is_kquant(kind: int) -> bool:
    return kind in BLOCK_BYTES


def _f16(b: torch.Tensor) -> torch.Tensor:
    """[..., 2] uint8 -> [...] float32 (little-endian float16)."""
    return b.contiguous().view(torch.float16).squeeze(-1).float()


def _scales_k4(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K's 12 file scale bytes [n, 12] -> (scales, mins) [n, 8] uint8."""
    d, m, md = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = torch.cat([d & 63, (md & 15) | ((d >> 2) & 48)], dim=1)
    mn = torch.cat([m & 63, (md >> 4) | ((m >> 2) & 48)], dim=1)
    return sc, mn


def repack(kind: int, raw: torch.Tensor) -> torch.Tensor:
    """A weight's file super-blocks [N, K / 256 * FILE_BYTES] -> the in-memory layout
    [N, K / 256 * BLOCK_BYTES]: Q4_K / Q5_K as d, dmin, 8 scales, 8 mins, then the rest of the
    block unchanged; Q6_K as it is."""
    if kind == Q6_K:
        return raw.contiguous()
    n = raw.shape[0]
    blocks = raw.reshape(-1, FILE_BYTES[kind])
    sc, mn = _scales_k4(blocks[:, 4:16])
    out = torch.cat([blocks[:, :4], sc, mn, blocks[:, 16:]], dim=1)
    return out.reshape(n, -1).contiguous()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[n, 128] bytes -> [n, 8, 32] codes: sub-block 2j low nibbles, 2j+1 high."""
    n = qs.shape[0]
    q = qs.reshape(n, 4, 1, 32) >> torch.tensor([0, 4], dtype=torch.uint8).reshape(1, 1, 2, 1)
    return (q & 15).reshape(n, 8, 32)


def dequantize_blocks(kind: int, blocks: torch.Tensor) -> torch.Tensor:
    """[n, BLOCK_BYTES] in-memory super-blocks -> [n, 256] float32."""
    n = blocks.shape[0]
    if kind == Q6_K:
        ql, qh, sc = blocks[:, :128], blocks[:, 128:192], blocks[:, 192:208]
        d = _f16(blocks[:, 208:210].reshape(n, 1, 2))
        lo = (ql.reshape(n, 2, 1, 64) >> torch.tensor([0, 4], dtype=torch.uint8)
              .reshape(1, 1, 2, 1)) & 15
        hi = (qh.reshape(n, 2, 1, 32) >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8)
              .reshape(1, 1, 4, 1)) & 3
        q = (lo.reshape(n, 8, 32) | (hi.reshape(n, 8, 32) << 4)).to(torch.int8) - 32
        ds = (d * sc.view(torch.int8).float()).reshape(n, 16, 1)
        return (ds * q.reshape(n, 16, 16).float()).reshape(n, SUPER_BLOCK)
    d = _f16(blocks[:, 0:2].reshape(n, 1, 2))
    dmin = _f16(blocks[:, 2:4].reshape(n, 1, 2))
    sc, mn = blocks[:, 4:12].float(), blocks[:, 12:20].float()
    if kind == Q4_K:
        q = _nibbles(blocks[:, 20:148])
    elif kind == Q5_K:
        high = (blocks[:, 20:52].reshape(n, 1, 32) >> torch.arange(8, dtype=torch.uint8)
                .reshape(1, 8, 1)) & 1
        q = _nibbles(blocks[:, 52:180]) | (high << 4)
    else:
        raise ValueError(f"kind {kind} is not a K-quant")
    ds = (d * sc).reshape(n, 8, 1)
    dm = (dmin * mn).reshape(n, 8, 1)
    return (ds * q.float() - dm).reshape(n, SUPER_BLOCK)


def dequantize(kind: int, q: torch.Tensor) -> torch.Tensor:
    """A weight's in-memory super-blocks [N, K / 256 * BLOCK_BYTES] -> [N, K] float32."""
    n = q.shape[0]
    blocks = q.reshape(-1, BLOCK_BYTES[kind])
    return dequantize_blocks(kind, blocks).reshape(n, -1)


def in_features(kind: int, q: torch.Tensor) -> int:
    row_bytes = q.shape[1]
    if row_bytes % BLOCK_BYTES[kind]:
        raise ValueError(f"a row of {row_bytes} bytes is not whole super-blocks of "
                         f"{BLOCK_BYTES[kind]} bytes")
    return row_bytes // BLOCK_BYTES[kind] * SUPER_BLOCK


def random_blocks(kind: int, n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """[n, k / 256 * FILE_BYTES] valid super-blocks (the file's layout) of random bytes whose
    float16 scales (d, and dmin) are drawn in [1e-4, 1e-3]: every code, sub-block scale and min
    pattern occurs, and no scale is a NaN, an infinity or a subnormal (the benchmarks' and the
    tests' weights)."""
    nb, size = k // SUPER_BLOCK, FILE_BYTES[kind]
    raw = torch.randint(0, 256, (n, nb, size), dtype=torch.uint8, generator=gen)

    def scales() -> torch.Tensor:
        d = torch.empty(n, nb).uniform_(1e-4, 1e-3, generator=gen).half()
        return d.view(torch.uint8).reshape(n, nb, 2)

    if kind == Q6_K:
        raw[..., 208:210] = scales()
    else:
        raw[..., 0:2] = scales()
        raw[..., 2:4] = scales()
    return raw.reshape(n, nb * size)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] as the kernels quantize it, per 256: (xq int8 [M, K], d float32 [M, K/256]),
    x ~ xq * d with d = max |x| / 127 and xq = round(x * (127 / max |x|)) (a true division,
    as the kernel divides)."""
    m, k = x.shape
    blocks = x.float().reshape(m, k // SUPER_BLOCK, SUPER_BLOCK)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    xq = torch.round(blocks * inv).to(torch.int8).reshape(m, k)
    return xq, (amax / 127).reshape(m, -1)


def activations_as_computed(x: torch.Tensor) -> torch.Tensor:
    """The fp32 activations the kernels' integer products stand for: xq * d per 256."""
    xq, d = quantize_activations(x)
    m, k = xq.shape
    return (xq.float().reshape(m, -1, SUPER_BLOCK) * d[..., None]).reshape(m, k)
