"""Triton versions of the fused elementwise operators in `fused_ref.py` (same signatures, same numerics).

Each public function is exactly ONE kernel launch (plus `torch.empty` for the outputs), so the
decode step's CUDA graph holds one node per operator. Grids are static functions of the tensor
shapes and nothing reads device values on the host: every function is CUDA-graph capturable.

Numerics follow the reference (HF Qwen3): math in fp32, rounded to the activation dtype at the
same points as the torch code:
- rms_norm: `n = (x * rsqrt(mean(x^2) + eps)).to(x.dtype)`, then `weight * n` rounded once to the
  promoted dtype of (weight, x).
- add_rms_norm: `s = (x + residual)` rounded to the activation dtype first; the norm reads the
  rounded `s` (as the reference does).
- qk_norm_rope, qk_norm_rope_store: see `triton_rope.py` (re-exported here).
- silu_and_mul: `silu(gate)` rounded to the dtype, then `* up` rounded.
For fp32 inputs every rounding step is a no-op.

Layout: the last dimension must be contiguous (other inputs are made so by `.contiguous()`,
which is an extra copy kernel: callers on the decode path should pass last-dim-contiguous
tensors). Leading dimensions may be strided views (e.g. q/k column slices of a fused qkv
projection output). Outputs are new contiguous tensors; inputs are never written (the KV caches
of `qk_norm_rope_store` are its outputs).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from modeling.ops.pdl import PDL_LAUNCH, pdl_launch_dependents, pdl_wait

_MAX_BLOCK = 65536  # one row lives in registers of one program
_SILU_BLOCK = 1024  # silu_and_mul is a pure elementwise op: columns are split over programs


def _row_warps(block: int) -> int:
    """~16 elements per thread: 128 -> 1 warp, 1024 -> 2, 4096 -> 8, 8192+ -> 16."""
    return max(1, min(16, block // 512))


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 or t.shape[-1] == 1 else t.contiguous()


def _check_block(block: int, what: str) -> None:
    if block > _MAX_BLOCK:
        raise ValueError(f"{what}: row of {block} elements exceeds the single-program limit {_MAX_BLOCK}")


# --------------------------------------------------------------------------------------------- rms_norm


@triton.jit
def _rms_norm_kernel(
    X,
    W,
    OUT,
    stride_xa,
    stride_xb,
    eps,
    H: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    """Grid (A, B): row (a, b) of a `[A, B, H]` view with strides (stride_xa, stride_xb, 1)."""
    pdl_launch_dependents(PDL)
    pdl_wait(PDL)
    a = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1).to(tl.int64)
    nb = tl.num_programs(1).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < H
    x = tl.load(X + a * stride_xa + b * stride_xb + offs, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / H + eps)
    n = (x * rstd).to(X.dtype.element_ty).to(tl.float32)
    w = tl.load(W + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(OUT + (a * nb + b) * H + offs, (n * w).to(OUT.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, pdl: int = 0) -> torch.Tensor:
    """x `[..., H]`, weight `[H]` -> contiguous `[..., H]` in the promoted dtype of (x, weight). `pdl`: the PDL
    mode of the launch (`modeling.ops.pdl`; 0 off), as in every wrapper here."""
    h = x.shape[-1]
    if weight.shape != (h,):
        raise ValueError(f"rms_norm: weight {tuple(weight.shape)} does not match hidden size {h}")
    x = _last_dim_contiguous(x)
    weight = weight.contiguous()
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    if x.dim() == 1:
        x3 = x.view(1, 1, h)
    elif x.dim() == 2:
        x3 = x.unsqueeze(1)
    elif x.dim() == 3:
        x3 = x
    else:
        x3 = x.reshape(-1, x.shape[-2], h)  # a view whenever the leading dims allow one
    if x3.shape[1] > 65535:  # CUDA limit on grid dim 1
        x3 = x3.reshape(-1, 1, h)
    a, b = x3.shape[0], x3.shape[1]
    if out.numel() == 0:
        return out
    block = triton.next_power_of_2(h)
    _check_block(block, "rms_norm")
    _rms_norm_kernel[(a, b)](
        x3,
        weight,
        out,
        x3.stride(0),
        x3.stride(1),
        eps,
        H=h,
        BLOCK=block,
        num_warps=_row_warps(block),
        **PDL_LAUNCH[pdl],
    )
    return out


# ----------------------------------------------------------------------------------------- add_rms_norm


@triton.jit
def add_rms_norm_row(x, R_ROW, SUM_ROW, OUT_ROW, w, offs, mask, h, eps):
    """One row of add_rms_norm, shared with the GEMM epilogue (`triton_gemm`): x and w are the row's fp32 values
    and the norm weight at `offs` (valid where `mask`), R_ROW / SUM_ROW / OUT_ROW point at the row's residual, sum
    and normed output, h is the row length. Stores the sum rounded to SUM's dtype, then the norm of that
    rounded sum."""
    r = tl.load(R_ROW + offs, mask=mask, other=0.0).to(tl.float32)
    s = (x + r).to(SUM_ROW.dtype.element_ty)
    tl.store(SUM_ROW + offs, s, mask=mask)
    sf = s.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(sf * sf, axis=0) / h + eps)
    n = (sf * rstd).to(SUM_ROW.dtype.element_ty).to(tl.float32)
    tl.store(OUT_ROW + offs, (n * w).to(OUT_ROW.dtype.element_ty), mask=mask)


@triton.jit
def _add_rms_norm_kernel(
    X,
    R,
    W,
    OUT,
    SUM,
    stride_x,
    stride_r,
    eps,
    H: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_launch_dependents(PDL)
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < H
    x = tl.load(X + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(W + offs, mask=mask, other=0.0).to(tl.float32)
    add_rms_norm_row(x, R + row * stride_r, SUM + row * H, OUT + row * H, w, offs, mask, H, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float, *, pdl: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual) for x, residual `[T, H]`; both outputs are new tensors."""
    if x.shape != residual.shape:
        raise ValueError(f"add_rms_norm: x {tuple(x.shape)} and residual {tuple(residual.shape)} differ")
    h = x.shape[-1]
    if weight.shape != (h,):
        raise ValueError(f"add_rms_norm: weight {tuple(weight.shape)} does not match hidden size {h}")
    x, residual = _last_dim_contiguous(x), _last_dim_contiguous(residual)
    weight = weight.contiguous()
    sum_dtype = torch.promote_types(x.dtype, residual.dtype)
    s = torch.empty(x.shape, dtype=sum_dtype, device=x.device)
    out = torch.empty(x.shape, dtype=torch.promote_types(sum_dtype, weight.dtype), device=x.device)
    if out.numel() == 0:
        return out, s
    x2, r2 = x.reshape(-1, h), residual.reshape(-1, h)  # views for 2-D inputs
    block = triton.next_power_of_2(h)
    _check_block(block, "add_rms_norm")
    _add_rms_norm_kernel[(x2.shape[0],)](
        x2,
        r2,
        weight,
        out,
        s,
        x2.stride(0),
        r2.stride(0),
        eps,
        H=h,
        BLOCK=block,
        num_warps=_row_warps(block),
        **PDL_LAUNCH[pdl],
    )
    return out, s


# ----------------------------------------------------------------------------------------- silu_and_mul


@triton.jit
def _silu_and_mul_kernel(
    X,
    OUT,
    stride_x,
    I: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    """Grid (T, cdiv(I, BLOCK)): columns [j*BLOCK, (j+1)*BLOCK) of row t."""
    pdl_launch_dependents(PDL)
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < I
    g = tl.load(X + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(X + row * stride_x + I + offs, mask=mask, other=0.0).to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(X.dtype.element_ty).to(tl.float32)
    tl.store(OUT + row * I + offs, (act * u).to(OUT.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor, *, pdl: int = 0) -> torch.Tensor:
    """x `[T, 2I]` (gate then up) -> silu(gate) * up `[T, I]` (leading dims beyond T are flattened)."""
    two_i = x.shape[-1]
    if two_i % 2:
        raise ValueError(f"silu_and_mul: last dim {two_i} must be even")
    i = two_i // 2
    x = _last_dim_contiguous(x)
    out = torch.empty((*x.shape[:-1], i), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    x2 = x.reshape(-1, two_i)  # a view for 2-D inputs
    block = min(triton.next_power_of_2(i), _SILU_BLOCK)
    _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(i, block))](
        x2,
        out,
        x2.stride(0),
        I=i,
        BLOCK=block,
        num_warps=max(1, min(4, block // 256)),
        **PDL_LAUNCH[pdl],
    )
    return out


from modeling.ops.triton_rope import qk_norm_rope, qk_norm_rope_store  # noqa: E402,F401 - one operator module per backend
