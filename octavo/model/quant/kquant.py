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
kernel's instructions per super-block. And every format's 256 codes are stored in lane order:
the kernels take a super-block as 8 vectors of 32 codes, and each 4-byte lane j of every vector
holds codes of one sub-block (Q4_K / Q5_K: sub-block j; Q6_K: vectors 0-3 sub-block j, vectors
4-7 sub-block 8 + j), so a vector's integer dot product (vpdpbusd) sums each sub-block in its own
lane and the sub-block scales apply once per super-block, in fp32, instead of once per 32
weights. Position p = 32 v + 4 j + b (vector v, lane j, byte b) holds the code of weight
LANE_ORDER[kind][p]; the bytes at the codes' places are the file's packing of the codes in that
order (`_pack` / `_unpack`). The activations are permuted the same way by the kernels. The
dequantization is gguf-py's (gguf.quants), bit for bit."""

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


def _lane_order(kind: int) -> torch.Tensor:
    """[256] int64: the weight (index in the super-block) whose code sits at each position."""
    p = torch.arange(SUPER_BLOCK)
    v, j, b = p // 32, (p % 32) // 4, p % 4
    if kind == Q6_K:  # 16 sub-blocks of 16: vectors 0-3 the first 8, 4-7 the last 8
        return 128 * (v // 4) + 16 * j + 4 * (v % 4) + b
    return 32 * j + 4 * v + b  # 8 sub-blocks of 32


LANE_ORDER = {kind: _lane_order(kind) for kind in (Q4_K, Q5_K, Q6_K)}
WEIGHT_POSITION = {kind: torch.argsort(order) for kind, order in LANE_ORDER.items()}


def _unpack(kind: int, codes: torch.Tensor) -> torch.Tensor:
    """The code bytes of [n] blocks in the file's packing (Q4_K: 128 nibble bytes, Q5_K: 32
    fifth-bit bytes then 128 nibble bytes, Q6_K: 128 bytes ql then 64 bytes qh) -> [n, 256]
    codes, in the order they are packed."""
    n = codes.shape[0]
    if kind == Q6_K:
        ql, qh = codes[:, :128], codes[:, 128:192]
        lo = (ql.reshape(n, 2, 1, 64) >> torch.tensor([0, 4], dtype=torch.uint8)
              .reshape(1, 1, 2, 1)) & 15
        hi = (qh.reshape(n, 2, 1, 32) >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8)
              .reshape(1, 1, 4, 1)) & 3
        return (lo.reshape(n, 256) | (hi.reshape(n, 256) << 4))
    if kind == Q4_K:
        return _nibbles(codes).reshape(n, 256)
    high = (codes[:, :32].reshape(n, 1, 32) >> torch.arange(8, dtype=torch.uint8)
            .reshape(1, 8, 1)) & 1
    return (_nibbles(codes[:, 32:160]) | (high << 4)).reshape(n, 256)


def _pack(kind: int, q: torch.Tensor) -> torch.Tensor:
    """_unpack's inverse: [n, 256] codes -> their code bytes in the file's packing."""
    n = q.shape[0]
    if kind == Q6_K:
        g = q.reshape(n, 2, 4, 32)  # half, group of 32
        lo, hi = g & 15, g >> 4
        ql = (lo[:, :, 0:2] | (lo[:, :, 2:4] << 4)).reshape(n, 128)
        qh = (hi[:, :, 0] | (hi[:, :, 1] << 2) | (hi[:, :, 2] << 4) | (hi[:, :, 3] << 6))
        return torch.cat([ql, qh.reshape(n, 64)], dim=1)
    g = q.reshape(n, 4, 2, 32)
    nib = ((g[:, :, 0] & 15) | ((g[:, :, 1] & 15) << 4)).reshape(n, 128)
    if kind == Q4_K:
        return nib
    bits = ((q.reshape(n, 8, 32) >> 4) & 1) << torch.arange(8, dtype=torch.uint8).reshape(1, 8, 1)
    return torch.cat([bits.sum(dim=1, dtype=torch.uint8), nib], dim=1)


CODES = {Q4_K: slice(20, 148), Q5_K: slice(20, 180), Q6_K: slice(0, 192)}  # in memory


def repack(kind: int, raw: torch.Tensor, compiled: bool = True,
           chunk: int = 1 << 16) -> torch.Tensor:
    """A weight's file super-blocks [N, K / 256 * FILE_BYTES] -> the in-memory layout
    [N, K / 256 * BLOCK_BYTES]: Q4_K / Q5_K as d, dmin, 8 scales, 8 mins, then the codes; Q6_K
    with the file's scales and d; every format's codes in lane order. By the compiled op where
    it builds (`compiled`; the same bytes, about 5x faster on a 1.5B model), else in torch,
    `chunk` super-blocks at a time (the unpacked codes take 256 bytes each)."""
    if compiled:
        from octavo.model.kernels.cpu_ops import load_cpu_ops

        ops = load_cpu_ops()
        if ops is not None:
            return ops.kquant_repack(kind, raw.contiguous())
    n = raw.shape[0]
    blocks = raw.reshape(-1, FILE_BYTES[kind])
    out = torch.empty(blocks.shape[0], BLOCK_BYTES[kind], dtype=torch.uint8)
    order = LANE_ORDER[kind]
    for s in range(0, blocks.shape[0], chunk):
        b, o = blocks[s:s + chunk], out[s:s + chunk]
        if kind == Q6_K:
            o[:, 192:] = b[:, 192:]
            codes = b[:, :192]
        else:
            sc, mn = _scales_k4(b[:, 4:16])
            o[:, :4], o[:, 4:12], o[:, 12:20] = b[:, :4], sc, mn
            codes = b[:, 16:]
        o[:, CODES[kind]] = _pack(kind, _unpack(kind, codes)[:, order])
    return out.reshape(n, -1)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[n, 128] bytes -> [n, 8, 32] codes: sub-block 2j low nibbles, 2j+1 high."""
    n = qs.shape[0]
    q = qs.reshape(n, 4, 1, 32) >> torch.tensor([0, 4], dtype=torch.uint8).reshape(1, 1, 2, 1)
    return (q & 15).reshape(n, 8, 32)


def codes(kind: int, blocks: torch.Tensor) -> torch.Tensor:
    """[n, BLOCK_BYTES] in-memory super-blocks -> [n, 256] codes in weight order."""
    return _unpack(kind, blocks[:, CODES[kind]])[:, WEIGHT_POSITION[kind]]


def dequantize_blocks(kind: int, blocks: torch.Tensor) -> torch.Tensor:
    """[n, BLOCK_BYTES] in-memory super-blocks -> [n, 256] float32."""
    n = blocks.shape[0]
    if kind not in BLOCK_BYTES:
        raise ValueError(f"kind {kind} is not a K-quant")
    q = codes(kind, blocks)
    if kind == Q6_K:
        d = _f16(blocks[:, 208:210].reshape(n, 1, 2))
        ds = (d * blocks[:, 192:208].view(torch.int8).float()).reshape(n, 16, 1)
        return (ds * (q.to(torch.int8) - 32).reshape(n, 16, 16).float()).reshape(n, SUPER_BLOCK)
    d = _f16(blocks[:, 0:2].reshape(n, 1, 2))
    dmin = _f16(blocks[:, 2:4].reshape(n, 1, 2))
    sc, mn = blocks[:, 4:12].float(), blocks[:, 12:20].float()
    ds = (d * sc).reshape(n, 8, 1)
    dm = (dmin * mn).reshape(n, 8, 1)
    return (ds * q.reshape(n, 8, 32).float() - dm).reshape(n, SUPER_BLOCK)


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
