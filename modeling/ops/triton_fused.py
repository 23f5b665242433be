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
- qk_norm_rope: per-head rms_norm as above, then `q*c + rotate_half(q)*s` with c/s cast to the
  activation dtype and each product and the sum rounded to that dtype, as torch does.
- silu_and_mul: `silu(gate)` rounded to the dtype, then `* up` rounded.
For fp32 inputs every rounding step is a no-op.

Layout: the last dimension must be contiguous (other inputs are made so by `.contiguous()`,
which is an extra copy kernel: callers on the decode path should pass last-dim-contiguous
tensors). Leading dimensions may be strided views (e.g. q/k column slices of a fused qkv
projection output). Outputs are new contiguous tensors; inputs are never written.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

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
):
    """Grid (A, B): row (a, b) of a `[A, B, H]` view with strides (stride_xa, stride_xb, 1)."""
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


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x `[..., H]`, weight `[H]` -> contiguous `[..., H]` in the promoted dtype of (x, weight)."""
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
    )
    return out


# ----------------------------------------------------------------------------------------- add_rms_norm


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
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < H
    x = tl.load(X + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    r = tl.load(R + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
    s = (x + r).to(SUM.dtype.element_ty)
    tl.store(SUM + row * H + offs, s, mask=mask)
    sf = s.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(sf * sf, axis=0) / H + eps)
    n = (sf * rstd).to(SUM.dtype.element_ty).to(tl.float32)
    w = tl.load(W + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(OUT + row * H + offs, (n * w).to(OUT.dtype.element_ty), mask=mask)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
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
    )
    return out, s


# ----------------------------------------------------------------------------------------- qk_norm_rope


@triton.jit
def _norm_rope_head(
    X,
    OUT,
    W,
    COS,
    SIN,
    x_off,
    out_off,
    cos_off,
    sin_off,
    eps,
    D: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One head of D: RMSNorm (rounded like the reference), then neox rotate-half rotary."""
    offs = tl.arange(0, BLOCK)
    mask = offs < HALF
    x1 = tl.load(X + x_off + offs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(X + x_off + HALF + offs, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt((tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) / D + eps)
    w1 = tl.load(W + offs, mask=mask, other=0.0).to(tl.float32)
    w2 = tl.load(W + HALF + offs, mask=mask, other=0.0).to(tl.float32)
    in_ty = X.dtype.element_ty
    out_ty = OUT.dtype.element_ty
    y1 = ((x1 * rstd).to(in_ty).to(tl.float32) * w1).to(out_ty).to(tl.float32)
    y2 = ((x2 * rstd).to(in_ty).to(tl.float32) * w2).to(out_ty).to(tl.float32)
    c1 = tl.load(COS + cos_off + offs, mask=mask, other=0.0).to(out_ty).to(tl.float32)
    c2 = tl.load(COS + cos_off + HALF + offs, mask=mask, other=0.0).to(out_ty).to(tl.float32)
    s1 = tl.load(SIN + sin_off + offs, mask=mask, other=0.0).to(out_ty).to(tl.float32)
    s2 = tl.load(SIN + sin_off + HALF + offs, mask=mask, other=0.0).to(out_ty).to(tl.float32)
    # rotate_half(y) = cat(-y2, y1); each product is rounded to the dtype before the sum, like torch.
    o1 = (y1 * c1).to(out_ty).to(tl.float32) + (-y2 * s1).to(out_ty).to(tl.float32)
    o2 = (y2 * c2).to(out_ty).to(tl.float32) + (y1 * s2).to(out_ty).to(tl.float32)
    tl.store(OUT + out_off + offs, o1.to(out_ty), mask=mask)
    tl.store(OUT + out_off + HALF + offs, o2.to(out_ty), mask=mask)


@triton.jit
def _qk_norm_rope_kernel(
    Q,
    K,
    QO,
    KO,
    QW,
    KW,
    COS,
    SIN,
    POS,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_cos,
    stride_sin,
    eps,
    HQ: tl.constexpr,
    HKV: tl.constexpr,
    D: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Grid (T, HQ + HKV): heads [0, HQ) are q heads, [HQ, HQ + HKV) are k heads."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    pos = tl.load(POS + t).to(tl.int64)
    cos_off = pos * stride_cos
    sin_off = pos * stride_sin
    if h < HQ:
        _norm_rope_head(Q, QO, QW, COS, SIN, t * stride_qt + h * stride_qh, (t * HQ + h) * D, cos_off, sin_off,
                        eps, D, HALF, BLOCK)
    else:
        hk = h - HQ
        _norm_rope_head(K, KO, KW, COS, SIN, t * stride_kt + hk * stride_kh, (t * HKV + hk) * D, cos_off, sin_off,
                        eps, D, HALF, BLOCK)


@triton.jit
def _norm_rope_heads(X, OUT, W, COS, SIN, x_tok, stride_h, out_tok, cos_off, sin_off, eps,
                     H: tl.constexpr, HB: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr, BLOCK: tl.constexpr):
    """All H heads of one token as one [HB, BLOCK] tile: same math and rounding as `_norm_rope_head`."""
    hs = tl.arange(0, HB)
    offs = tl.arange(0, BLOCK)
    mask = (hs[:, None] < H) & (offs[None, :] < HALF)
    base = X + x_tok + hs[:, None] * stride_h + offs[None, :]
    x1 = tl.load(base, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / D + eps)[:, None]
    w1 = tl.load(W + offs, mask=offs < HALF, other=0.0).to(tl.float32)[None, :]
    w2 = tl.load(W + HALF + offs, mask=offs < HALF, other=0.0).to(tl.float32)[None, :]
    in_ty = X.dtype.element_ty
    out_ty = OUT.dtype.element_ty
    y1 = ((x1 * rstd).to(in_ty).to(tl.float32) * w1).to(out_ty).to(tl.float32)
    y2 = ((x2 * rstd).to(in_ty).to(tl.float32) * w2).to(out_ty).to(tl.float32)
    hm = offs < HALF
    c1 = tl.load(COS + cos_off + offs, mask=hm, other=0.0).to(out_ty).to(tl.float32)[None, :]
    c2 = tl.load(COS + cos_off + HALF + offs, mask=hm, other=0.0).to(out_ty).to(tl.float32)[None, :]
    s1 = tl.load(SIN + sin_off + offs, mask=hm, other=0.0).to(out_ty).to(tl.float32)[None, :]
    s2 = tl.load(SIN + sin_off + HALF + offs, mask=hm, other=0.0).to(out_ty).to(tl.float32)[None, :]
    o1 = (y1 * c1).to(out_ty).to(tl.float32) + (-y2 * s1).to(out_ty).to(tl.float32)
    o2 = (y2 * c2).to(out_ty).to(tl.float32) + (y1 * s2).to(out_ty).to(tl.float32)
    obase = OUT + out_tok + hs[:, None] * D + offs[None, :]
    tl.store(obase, o1.to(out_ty), mask=mask)
    tl.store(obase + HALF, o2.to(out_ty), mask=mask)


@triton.jit
def _qk_norm_rope_token_kernel(Q, K, QO, KO, QW, KW, COS, SIN, POS, stride_qt, stride_qh, stride_kt, stride_kh,
                               stride_cos, stride_sin, eps, HQ: tl.constexpr, HKV: tl.constexpr, HQB: tl.constexpr,
                               HKB: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr, BLOCK: tl.constexpr):
    """Grid (T,): one program per token, all q and k heads (prefill: T x (HQ + HKV) tiny programs cost more)."""
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(POS + t).to(tl.int64)
    _norm_rope_heads(Q, QO, QW, COS, SIN, t * stride_qt, stride_qh, t * HQ * D, pos * stride_cos, pos * stride_sin,
                     eps, HQ, HQB, D, HALF, BLOCK)
    _norm_rope_heads(K, KO, KW, COS, SIN, t * stride_kt, stride_kh, t * HKV * D, pos * stride_cos, pos * stride_sin,
                     eps, HKV, HKB, D, HALF, BLOCK)


_TOKEN_KERNEL_MIN_T = 64  # below this, one program per head keeps more SMs busy (decode)


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor, positions: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head RMSNorm of q `[T, Hq, D]` and k `[T, Hkv, D]` then neox rotary at `positions` `[T]`
    (fp32 tables cos/sin `[max_pos, D]`). q/k may be strided views (last dim contiguous).
    Returns new contiguous tensors, in one kernel launch for both."""
    if q.dim() != 3 or k.dim() != 3:
        raise ValueError(f"qk_norm_rope: q {tuple(q.shape)} and k {tuple(k.shape)} must be [T, heads, D]")
    t, hq, d = q.shape
    hkv = k.shape[1]
    if k.shape[0] != t or k.shape[2] != d:
        raise ValueError(f"qk_norm_rope: q {tuple(q.shape)} and k {tuple(k.shape)} do not match")
    if d % 2:
        raise ValueError(f"qk_norm_rope: head_dim {d} must be even")
    if q_weight.shape != (d,) or k_weight.shape != (d,):
        raise ValueError(f"qk_norm_rope: weights {tuple(q_weight.shape)}, {tuple(k_weight.shape)} must be [{d}]")
    if cos.shape[-1] != d or sin.shape[-1] != d:
        raise ValueError(f"qk_norm_rope: rotary tables {tuple(cos.shape)} do not have head_dim {d}")
    if positions.shape[0] < t:
        raise ValueError(f"qk_norm_rope: {positions.shape[0]} positions for {t} tokens")
    q, k = _last_dim_contiguous(q), _last_dim_contiguous(k)
    cos, sin = _last_dim_contiguous(cos), _last_dim_contiguous(sin)
    q_weight, k_weight = q_weight.contiguous(), k_weight.contiguous()
    q_out = torch.empty((t, hq, d), dtype=torch.promote_types(q.dtype, q_weight.dtype), device=q.device)
    k_out = torch.empty((t, hkv, d), dtype=torch.promote_types(k.dtype, k_weight.dtype), device=k.device)
    if t == 0 or hq + hkv == 0:
        return q_out, k_out
    half = d // 2
    block = triton.next_power_of_2(half)
    if t >= _TOKEN_KERNEL_MIN_T and hq * block <= 8192:
        _qk_norm_rope_token_kernel[(t,)](
            q, k, q_out, k_out, q_weight, k_weight, cos, sin, positions, q.stride(0), q.stride(1), k.stride(0),
            k.stride(1), cos.stride(0), sin.stride(0), eps, HQ=hq, HKV=hkv, HQB=triton.next_power_of_2(hq),
            HKB=triton.next_power_of_2(hkv), D=d, HALF=half, BLOCK=block, num_warps=4,
        )
        return q_out, k_out
    _qk_norm_rope_kernel[(t, hq + hkv)](
        q,
        k,
        q_out,
        k_out,
        q_weight,
        k_weight,
        cos,
        sin,
        positions,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        cos.stride(0),
        sin.stride(0),
        eps,
        HQ=hq,
        HKV=hkv,
        D=d,
        HALF=half,
        BLOCK=block,
        num_warps=max(1, min(4, block // 64)),
    )
    return q_out, k_out


# ----------------------------------------------------------------------------------------- silu_and_mul


@triton.jit
def _silu_and_mul_kernel(
    X,
    OUT,
    stride_x,
    I: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Grid (T, cdiv(I, BLOCK)): columns [j*BLOCK, (j+1)*BLOCK) of row t."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < I
    g = tl.load(X + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(X + row * stride_x + I + offs, mask=mask, other=0.0).to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(X.dtype.element_ty).to(tl.float32)
    tl.store(OUT + row * I + offs, (act * u).to(OUT.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
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
    )
    return out
