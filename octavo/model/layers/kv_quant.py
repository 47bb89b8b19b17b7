"""Quantized KV pages (`kv_cache_dtype`): how K and V rows are stored in the paged cache and
read back.

- `auto`: the model dtype, exactly as without this module.
- `int8`: symmetric, one fp32 scale per token and KV head. Each (token, KV head) row of a page
  holds its head_dim int8 values followed by the 4 bytes of its scale, so the scales are paged
  exactly like the values: a block is still one slice of the cache tensor, copy-on-write,
  swaps and forks move both, and a decode kernel finds a row's scale in the cache line it
  reads the values from. A row is head_dim + 4 bytes: 68 for head_dim 64, 1.88x fewer than
  bf16 and 3.76x fewer than fp32.
- `fp8` (= `fp8_e4m3`, as in vLLM) and `fp8_e5m2`: torch.float8 storage of value / scale,
  with one fp32 scale per KV head for each layer's K and each layer's V, taken from the
  checkpoint's k_scale / v_scale (one per tensor) or computed from a calibration prompt at
  start-up (model/worker/kv_calibration.py).

The arithmetic below is the definition every kernel (C++, Triton) reproduces bit for bit:
  int8: s = max(amax_d |x_d|, 1e-12) / 127, q_d = rint(x_d / s) in [-127, 127], x_d ~ q_d * s
  fp8:  y_d = fp8(clamp(x_d / scale_h, -max, max)) (round to nearest even), x_d ~ y_d * scale_h
With `kv_smooth_keys` (kv_smoothing.py) the keys a layer hands its backend are already centred
and rotated, and the queries and values rotated alike; the arithmetic here does not change.
Quantization is per token: the bytes stored for a token depend on that token's K (V) alone,
never on the batch, the chunk or the step it was computed in. Attention always reads what is
stored, the current chunk's own tokens included.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from octavo.model.layers.kv_smoothing import smooth_qkv, unrotate

INT8_QMAX = 127.0
INT8_SCALE_BYTES = 4  # the fp32 scale after each row's values
FP8_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
ALIASES = {"fp8": "fp8_e4m3"}


@dataclass(frozen=True, slots=True)
class KVFormat:
    """How one (token, KV head) row of K or V is stored."""

    name: str  # auto, int8, fp8_e4m3 or fp8_e5m2
    dtype: torch.dtype  # the cache tensor's element type
    scale_bytes: int = 0  # int8: the row's fp32 scale, after its values

    @property
    def quantized(self) -> bool:
        return self.name != "auto"

    @property
    def is_fp8(self) -> bool:
        return self.name in FP8_DTYPES

    def row_elems(self, head_dim: int) -> int:
        """Elements of the cache tensor's last dim (int8: values, then the scale's bytes)."""
        return head_dim + self.scale_bytes

    def row_bytes(self, head_dim: int) -> int:
        return self.row_elems(head_dim) * torch.empty((), dtype=self.dtype).element_size()

    @property
    def fp8_max(self) -> float:
        return float(torch.finfo(self.dtype).max)


def kv_format(kv_cache_dtype: str, model_dtype: torch.dtype) -> KVFormat:
    name = ALIASES.get(kv_cache_dtype, kv_cache_dtype)
    if name == "auto":
        return KVFormat("auto", model_dtype)
    if name == "int8":
        return KVFormat("int8", torch.int8, INT8_SCALE_BYTES)
    if name in FP8_DTYPES:
        return KVFormat(name, FP8_DTYPES[name])
    raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} is not one of auto, int8, fp8, "
                     "fp8_e4m3, fp8_e5m2")


@dataclass(frozen=True, slots=True)
class KVQuant:
    """What an attention layer hands its backend about its quantized pages: the format and,
    for fp8, the layer's scales ([num_kv_heads] float32, on the cache's device; None for
    int8, whose scales are in the pages). `k_offset` and `rotation`: the layer's key smoothing
    (kv_smoothing.py), applied by the layer to q, k and v before the backend sees them and to
    the output after."""

    fmt: KVFormat
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None
    k_offset: torch.Tensor | None = None  # [num_kv_heads, head_dim] float32
    rotation: torch.Tensor | None = None  # [head_dim, head_dim] float32, orthonormal

    def smooth(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k and v as this layer's pages expect them (kv_smoothing.smooth_qkv)."""
        return smooth_qkv(q, k, v, self.k_offset, self.rotation)

    def unsmooth(self, o: torch.Tensor) -> torch.Tensor:
        """The attention output over smoothed values, turned back (kv_smoothing.unrotate)."""
        return unrotate(o, self.rotation)

    def __post_init__(self) -> None:
        if self.fmt.is_fp8 and (self.k_scale is None or self.v_scale is None):
            raise ValueError(f"kv_cache_dtype={self.fmt.name} needs a K and a V scale per layer")


def quantize(x: torch.Tensor, fmt: KVFormat, scale: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., kv_heads, head_dim] (any float dtype) -> rows [..., kv_heads, row_elems] of
    fmt.dtype, as the cache stores them."""
    xf = x.float()
    if fmt.name == "int8":
        s = xf.abs().amax(-1, keepdim=True).clamp_min(1e-12) / INT8_QMAX
        q = torch.round(xf / s).clamp_(-INT8_QMAX, INT8_QMAX).to(torch.int8)
        return torch.cat([q, s.view(torch.int8)], dim=-1)
    if fmt.is_fp8:
        assert scale is not None
        m = fmt.fp8_max
        return (xf / scale.float()[:, None]).clamp_(-m, m).to(fmt.dtype)
    raise ValueError(f"{fmt.name} is not a quantized KV format")


def dequantize(rows: torch.Tensor, fmt: KVFormat, scale: torch.Tensor | None = None
               ) -> torch.Tensor:
    """Stored rows [..., kv_heads, row_elems] -> fp32 [..., kv_heads, head_dim]."""
    if fmt.name == "int8":
        head_dim = rows.shape[-1] - fmt.scale_bytes
        s = rows[..., head_dim:].contiguous().view(torch.float32)
        return rows[..., :head_dim].float() * s
    if fmt.is_fp8:
        assert scale is not None
        return rows.float() * scale.float()[:, None]
    raise ValueError(f"{fmt.name} is not a quantized KV format")


def write_quantized(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                    quant: KVQuant) -> tuple[torch.Tensor, torch.Tensor]:
    """Store the step's K/V rows at the slot mapping, quantized; returns them as stored, in
    fp32 (what attention must read for the step's own tokens)."""
    kq = quantize(k, quant.fmt, quant.k_scale)
    vq = quantize(v, quant.fmt, quant.v_scale)
    heads, width = kq.shape[1], kq.shape[2]
    for cache, rows in ((k_cache, kq), (v_cache, vq)):
        as_bytes(cache).view(-1, heads, width).index_copy_(0, slot_mapping, as_bytes(rows))
    return dequantize(kq, quant.fmt, quant.k_scale), dequantize(vq, quant.fmt, quant.v_scale)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A 1-byte tensor as uint8, for the indexing ops torch lacks for float8."""
    return t.view(torch.uint8)


def gather_rows(cache: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """cache[index] for a cache of quantized rows (float8 included)."""
    return as_bytes(cache)[index].view(cache.dtype)
