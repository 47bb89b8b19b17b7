"""A Llama layer's elementwise parts in Triton, fused: RMSNorm (after the residual add), RoPE in
place on q and k, SiLU-and-mul. The same op order and roundings as transformers' torch code
(and octavo's compiled CPU ops, csrc/fused_ops.cpp): statistics in fp32, the normalised row
rounded to the model dtype before the weight multiplies it, cos/sin rounded to the model dtype,
each product rounded as torch rounds it.

`TritonFusedOps` has the interface layers.py calls (`rms_norm`, `add_rms_norm_`, `rope_`,
`silu_and_mul`), so `model.use_cpu_ops(TritonFusedOps())` switches a model over.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from octavo.model.kernels.triton import check_device, interpreted, jit


@jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, stride_x, stride_r, stride_o, eps, rows,
                     N: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr,
                     ADD_RESIDUAL: tl.constexpr):
    r = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)[:, None]
    offs = tl.arange(0, BLOCK)[None, :]
    mask = (r < rows) & (offs < N)
    x = tl.load(x_ptr + r * stride_x + offs, mask=mask, other=0.0)
    if ADD_RESIDUAL:  # residual += x, rounded to the model dtype, kept for the next layer
        x = (tl.load(res_ptr + r * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
             + x.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(res_ptr + r * stride_r + offs, x, mask=mask)
    h = x.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(h * h, 1) / N + eps)
    h = (h * inv[:, None]).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=offs < N, other=0.0).to(tl.float32)
    tl.store(out_ptr + r * stride_o + offs, (w * h).to(out_ptr.dtype.element_ty), mask=mask)


@jit
def _rope_kernel(qkv_ptr, cos_ptr, sin_ptr, stride_t, stride_c, rows,
                 HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_HEADS: tl.constexpr,
                 BLOCK_HALF: tl.constexpr, ROWS: tl.constexpr):
    t = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    half = HEAD_DIM // 2
    i = tl.arange(0, BLOCK_HALF)
    cs_mask = (t < rows)[:, None] & (i < half)[None, :]  # [ROWS, BLOCK_HALF]
    dt = qkv_ptr.dtype.element_ty
    cs = t[:, None] * stride_c + i[None, :]
    c1 = tl.load(cos_ptr + cs, mask=cs_mask, other=0.0).to(dt).to(tl.float32)[:, None, :]
    c2 = tl.load(cos_ptr + cs + half, mask=cs_mask, other=0.0).to(dt).to(tl.float32)[:, None, :]
    s1 = tl.load(sin_ptr + cs, mask=cs_mask, other=0.0).to(dt).to(tl.float32)[:, None, :]
    s2 = tl.load(sin_ptr + cs + half, mask=cs_mask, other=0.0).to(dt).to(tl.float32)[:, None, :]
    hd = tl.arange(0, BLOCK_HEADS)
    mask = cs_mask[:, None, :] & (hd < HEADS)[None, :, None]  # [ROWS, BLOCK_HEADS, BLOCK_HALF]
    base = qkv_ptr + t[:, None, None] * stride_t + hd[None, :, None] * HEAD_DIM + i[None, None, :]
    x1 = tl.load(base, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + half, mask=mask, other=0.0).to(tl.float32)
    o1 = (x1 * c1).to(dt).to(tl.float32) + (-x2 * s1).to(dt).to(tl.float32)
    o2 = (x2 * c2).to(dt).to(tl.float32) + (x1 * s2).to(dt).to(tl.float32)
    tl.store(base, o1.to(dt), mask=mask)
    tl.store(base + half, o2.to(dt), mask=mask)


@jit
def _silu_and_mul_kernel(gu_ptr, out_ptr, stride_g, stride_o, rows, N: tl.constexpr,
                         BLOCK: tl.constexpr, ROWS: tl.constexpr):
    r = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)[:, None]
    offs = (tl.program_id(1) * BLOCK + tl.arange(0, BLOCK))[None, :]
    mask = (r < rows) & (offs < N)
    g = tl.load(gu_ptr + r * stride_g + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + r * stride_g + N + offs, mask=mask, other=0.0).to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + r * stride_o + offs, (act * u).to(out_ptr.dtype.element_ty), mask=mask)


def rows_per_program(row_elems: int) -> int:
    """Rows one program takes: enough to give it ~4k elements on a GPU (one row of a large
    hidden size); 64 in the interpreter, whose cost is per program."""
    if interpreted():
        return 64
    return max(1, min(16, 4096 // triton.next_power_of_2(max(row_elems, 1))))


def _rows(x: torch.Tensor) -> torch.Tensor:
    assert x.dim() == 2 and x.stride(1) == 1, "a [tokens, hidden] tensor with contiguous rows"
    check_device(x)
    return x


class TritonFusedOps:
    """The fused ops on Triton (layers.py calls them where `ops` is set)."""

    @staticmethod
    def isa() -> str:
        return "triton"

    @staticmethod
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        x = _rows(x)
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
        if x.shape[0]:
            n, rows = x.shape[1], rows_per_program(x.shape[1])
            _rms_norm_kernel[(triton.cdiv(x.shape[0], rows),)](
                x, x, weight, out, x.stride(0), 0, out.stride(0), eps, x.shape[0], N=n,
                BLOCK=triton.next_power_of_2(n), ROWS=rows, ADD_RESIDUAL=False)
        return out

    @staticmethod
    def add_rms_norm_(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                      eps: float) -> torch.Tensor:
        """residual += x (in place), then the norm of the new residual."""
        x, residual = _rows(x), _rows(residual)
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
        if x.shape[0]:
            n, rows = x.shape[1], rows_per_program(x.shape[1])
            _rms_norm_kernel[(triton.cdiv(x.shape[0], rows),)](
                x, residual, weight, out, x.stride(0), residual.stride(0), out.stride(0), eps,
                x.shape[0], N=n, BLOCK=triton.next_power_of_2(n), ROWS=rows, ADD_RESIDUAL=True)
        return out

    @staticmethod
    def rope_(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int,
              num_kv_heads: int, head_dim: int) -> None:
        """q and k heads of a fused [T, width] qkv buffer rotated in place; cos/sin fp32
        [T, head_dim]."""
        qkv = _rows(qkv)
        assert cos.dtype == torch.float32 and cos.is_contiguous() and sin.is_contiguous()
        if qkv.shape[0]:
            heads = num_heads + num_kv_heads
            rows = rows_per_program(heads * head_dim)
            _rope_kernel[(triton.cdiv(qkv.shape[0], rows),)](
                qkv, cos, sin, qkv.stride(0), cos.stride(0), qkv.shape[0], HEADS=heads,
                HEAD_DIM=head_dim, BLOCK_HEADS=triton.next_power_of_2(heads),
                BLOCK_HALF=triton.next_power_of_2(head_dim // 2), ROWS=rows)

    @staticmethod
    def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
        gate_up = _rows(gate_up)
        rows, n = gate_up.shape[0], gate_up.shape[1] // 2
        out = torch.empty(rows, n, dtype=gate_up.dtype, device=gate_up.device)
        if rows:
            block = min(1024, triton.next_power_of_2(n))
            per = rows_per_program(block)
            _silu_and_mul_kernel[(triton.cdiv(rows, per), triton.cdiv(n, block))](
                gate_up, out, gate_up.stride(0), out.stride(0), rows, N=n, BLOCK=block,
                ROWS=per)
        return out
