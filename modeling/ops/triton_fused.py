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
- qk_norm_rope_store: `qk_norm_rope` followed by `triton_store.store_kv` of its k (and v) in one
  kernel: the same variant (per head or per token, picked by `_use_token_kernel`), the same code
  (`_norm_rope_head[s]_values`) and k rounded to the dtype `qk_norm_rope` returns before the cast to
  the cache dtype, so q, the cache rows and the skipped rows are bitwise those of the two kernels.
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
def _norm_rope_head_values(X, W, COS, SIN, x_off, cos_off, sin_off, eps, OUT_TY: tl.constexpr, D: tl.constexpr,
                           HALF: tl.constexpr, BLOCK: tl.constexpr):
    """One head of D: RMSNorm (rounded like the reference), then neox rotate-half rotary.
    Returns the two halves as `[BLOCK]` values of dtype OUT_TY (lanes >= HALF are padding)."""
    offs = tl.arange(0, BLOCK)
    mask = offs < HALF
    x1 = tl.load(X + x_off + offs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(X + x_off + HALF + offs, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt((tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) / D + eps)
    w1 = tl.load(W + offs, mask=mask, other=0.0).to(tl.float32)
    w2 = tl.load(W + HALF + offs, mask=mask, other=0.0).to(tl.float32)
    in_ty = X.dtype.element_ty
    y1 = ((x1 * rstd).to(in_ty).to(tl.float32) * w1).to(OUT_TY).to(tl.float32)
    y2 = ((x2 * rstd).to(in_ty).to(tl.float32) * w2).to(OUT_TY).to(tl.float32)
    c1 = tl.load(COS + cos_off + offs, mask=mask, other=0.0).to(OUT_TY).to(tl.float32)
    c2 = tl.load(COS + cos_off + HALF + offs, mask=mask, other=0.0).to(OUT_TY).to(tl.float32)
    s1 = tl.load(SIN + sin_off + offs, mask=mask, other=0.0).to(OUT_TY).to(tl.float32)
    s2 = tl.load(SIN + sin_off + HALF + offs, mask=mask, other=0.0).to(OUT_TY).to(tl.float32)
    # rotate_half(y) = cat(-y2, y1); each product is rounded to the dtype before the sum, like torch.
    o1 = (y1 * c1).to(OUT_TY).to(tl.float32) + (-y2 * s1).to(OUT_TY).to(tl.float32)
    o2 = (y2 * c2).to(OUT_TY).to(tl.float32) + (y1 * s2).to(OUT_TY).to(tl.float32)
    return o1.to(OUT_TY), o2.to(OUT_TY)


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
    """One head of D, normalised and rotated (`_norm_rope_head_values`), stored to OUT at out_off."""
    o1, o2 = _norm_rope_head_values(X, W, COS, SIN, x_off, cos_off, sin_off, eps, OUT.dtype.element_ty, D, HALF, BLOCK)
    offs = tl.arange(0, BLOCK)
    mask = offs < HALF
    tl.store(OUT + out_off + offs, o1, mask=mask)
    tl.store(OUT + out_off + HALF + offs, o2, mask=mask)


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
def _norm_rope_heads_values(X, W, COS, SIN, x_tok, stride_h, cos_off, sin_off, eps, OUT_TY: tl.constexpr,
                            H: tl.constexpr, HB: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr,
                            BLOCK: tl.constexpr):
    """All H heads of one token as one [HB, BLOCK] tile: same math and rounding as `_norm_rope_head_values`.
    Returns the two halves as `[HB, BLOCK]` values of dtype OUT_TY."""
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
    y1 = ((x1 * rstd).to(in_ty).to(tl.float32) * w1).to(OUT_TY).to(tl.float32)
    y2 = ((x2 * rstd).to(in_ty).to(tl.float32) * w2).to(OUT_TY).to(tl.float32)
    hm = offs < HALF
    c1 = tl.load(COS + cos_off + offs, mask=hm, other=0.0).to(OUT_TY).to(tl.float32)[None, :]
    c2 = tl.load(COS + cos_off + HALF + offs, mask=hm, other=0.0).to(OUT_TY).to(tl.float32)[None, :]
    s1 = tl.load(SIN + sin_off + offs, mask=hm, other=0.0).to(OUT_TY).to(tl.float32)[None, :]
    s2 = tl.load(SIN + sin_off + HALF + offs, mask=hm, other=0.0).to(OUT_TY).to(tl.float32)[None, :]
    o1 = (y1 * c1).to(OUT_TY).to(tl.float32) + (-y2 * s1).to(OUT_TY).to(tl.float32)
    o2 = (y2 * c2).to(OUT_TY).to(tl.float32) + (y1 * s2).to(OUT_TY).to(tl.float32)
    return o1.to(OUT_TY), o2.to(OUT_TY)


@triton.jit
def _norm_rope_heads(X, OUT, W, COS, SIN, x_tok, stride_h, out_tok, cos_off, sin_off, eps,
                     H: tl.constexpr, HB: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr, BLOCK: tl.constexpr):
    """All H heads of one token (`_norm_rope_heads_values`), stored contiguously to OUT at out_tok."""
    o1, o2 = _norm_rope_heads_values(X, W, COS, SIN, x_tok, stride_h, cos_off, sin_off, eps, OUT.dtype.element_ty,
                                     H, HB, D, HALF, BLOCK)
    hs = tl.arange(0, HB)
    offs = tl.arange(0, BLOCK)
    mask = (hs[:, None] < H) & (offs[None, :] < HALF)
    obase = OUT + out_tok + hs[:, None] * D + offs[None, :]
    tl.store(obase, o1, mask=mask)
    tl.store(obase + HALF, o2, mask=mask)


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


def _use_token_kernel(t: int, hq: int, block: int) -> bool:
    """The one variant choice of `qk_norm_rope` and `qk_norm_rope_store` (same choice = same reductions = same bits)."""
    return t >= _TOKEN_KERNEL_MIN_T and hq * block <= 8192


def _check_qk(what: str, q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
              cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor) -> tuple[int, int, int, int]:
    """Shape checks shared by `qk_norm_rope` and `qk_norm_rope_store`; returns (T, Hq, Hkv, D)."""
    if q.dim() != 3 or k.dim() != 3:
        raise ValueError(f"{what}: q {tuple(q.shape)} and k {tuple(k.shape)} must be [T, heads, D]")
    t, hq, d = q.shape
    hkv = k.shape[1]
    if k.shape[0] != t or k.shape[2] != d:
        raise ValueError(f"{what}: q {tuple(q.shape)} and k {tuple(k.shape)} do not match")
    if d % 2:
        raise ValueError(f"{what}: head_dim {d} must be even")
    if q_weight.shape != (d,) or k_weight.shape != (d,):
        raise ValueError(f"{what}: weights {tuple(q_weight.shape)}, {tuple(k_weight.shape)} must be [{d}]")
    if cos.shape[-1] != d or sin.shape[-1] != d:
        raise ValueError(f"{what}: rotary tables {tuple(cos.shape)} do not have head_dim {d}")
    if positions.shape[0] < t:
        raise ValueError(f"{what}: {positions.shape[0]} positions for {t} tokens")
    return t, hq, hkv, d


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor, positions: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head RMSNorm of q `[T, Hq, D]` and k `[T, Hkv, D]` then neox rotary at `positions` `[T]`
    (fp32 tables cos/sin `[max_pos, D]`). q/k may be strided views (last dim contiguous).
    Returns new contiguous tensors, in one kernel launch for both."""
    t, hq, hkv, d = _check_qk("qk_norm_rope", q, k, q_weight, k_weight, cos, sin, positions)
    q, k = _last_dim_contiguous(q), _last_dim_contiguous(k)
    cos, sin = _last_dim_contiguous(cos), _last_dim_contiguous(sin)
    q_weight, k_weight = q_weight.contiguous(), k_weight.contiguous()
    q_out = torch.empty((t, hq, d), dtype=torch.promote_types(q.dtype, q_weight.dtype), device=q.device)
    k_out = torch.empty((t, hkv, d), dtype=torch.promote_types(k.dtype, k_weight.dtype), device=k.device)
    if t == 0 or hq + hkv == 0:
        return q_out, k_out
    half = d // 2
    block = triton.next_power_of_2(half)
    if _use_token_kernel(t, hq, block):
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


# ----------------------------------------------------------------------------------- qk_norm_rope_store

_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


@triton.jit
def _store_slot(SLOTS, t, n_slots):
    """Flat cache slot of row t, or -1 where `store_kv` would skip it (slot < 0 or t >= len(slot_mapping))."""
    return tl.load(SLOTS + t, mask=t < n_slots, other=-1).to(tl.int64)


@triton.jit
def _qk_norm_rope_store_kernel(
    Q, K, V, QO, QW, KW, COS, SIN, POS, K_CACHE, V_CACHE, SLOTS, n_slots,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_cos, stride_sin,
    stride_kcb, stride_kct, stride_kch, stride_vcb, stride_vct, stride_vch, eps,
    HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr, BLOCK: tl.constexpr,
    BLOCK_D: tl.constexpr, PAGE: tl.constexpr, KO_TY: tl.constexpr,
):
    """Grid (T, HQ + HKV) like `_qk_norm_rope_kernel`: q heads go to QO; k head hk of a stored row goes to
    K_CACHE (rounded to KO_TY, the dtype `qk_norm_rope` returns k in, then to the cache's) with v head hk."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    pos = tl.load(POS + t).to(tl.int64)
    cos_off = pos * stride_cos
    sin_off = pos * stride_sin
    if h < HQ:
        _norm_rope_head(Q, QO, QW, COS, SIN, t * stride_qt + h * stride_qh, (t * HQ + h) * D, cos_off, sin_off,
                        eps, D, HALF, BLOCK)
    else:
        slot = _store_slot(SLOTS, t, n_slots)
        if slot >= 0:
            hk = h - HQ
            o1, o2 = _norm_rope_head_values(K, KW, COS, SIN, t * stride_kt + hk * stride_kh, cos_off, sin_off, eps,
                                            KO_TY, D, HALF, BLOCK)
            page = slot // PAGE
            off = slot % PAGE
            offs = tl.arange(0, BLOCK)
            mask = offs < HALF
            dst_k = K_CACHE + page * stride_kcb + off * stride_kct + hk * stride_kch + offs
            tl.store(dst_k, o1.to(K_CACHE.dtype.element_ty), mask=mask)
            tl.store(dst_k + HALF, o2.to(K_CACHE.dtype.element_ty), mask=mask)
            offs_d = tl.arange(0, BLOCK_D)
            mask_d = offs_d < D
            v = tl.load(V + t * stride_vt + hk * stride_vh + offs_d, mask=mask_d)
            dst_v = V_CACHE + page * stride_vcb + off * stride_vct + hk * stride_vch + offs_d
            tl.store(dst_v, v.to(V_CACHE.dtype.element_ty), mask=mask_d)


@triton.jit
def _qk_norm_rope_store_token_kernel(
    Q, K, V, QO, QW, KW, COS, SIN, POS, K_CACHE, V_CACHE, SLOTS, n_slots,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_cos, stride_sin,
    stride_kcb, stride_kct, stride_kch, stride_vcb, stride_vct, stride_vch, eps,
    HQ: tl.constexpr, HKV: tl.constexpr, HQB: tl.constexpr, HKB: tl.constexpr, D: tl.constexpr,
    HALF: tl.constexpr, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr, KO_TY: tl.constexpr,
):
    """Grid (T,) like `_qk_norm_rope_token_kernel`: all q heads to QO; all k and v heads of a stored row to the
    caches."""
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(POS + t).to(tl.int64)
    cos_off = pos * stride_cos
    sin_off = pos * stride_sin
    _norm_rope_heads(Q, QO, QW, COS, SIN, t * stride_qt, stride_qh, t * HQ * D, cos_off, sin_off, eps,
                     HQ, HQB, D, HALF, BLOCK)
    slot = _store_slot(SLOTS, t, n_slots)
    if slot >= 0:
        o1, o2 = _norm_rope_heads_values(K, KW, COS, SIN, t * stride_kt, stride_kh, cos_off, sin_off, eps, KO_TY,
                                         HKV, HKB, D, HALF, BLOCK)
        page = slot // PAGE
        off = slot % PAGE
        hs = tl.arange(0, HKB)
        offs = tl.arange(0, BLOCK)
        mask = (hs[:, None] < HKV) & (offs[None, :] < HALF)
        dst_k = K_CACHE + page * stride_kcb + off * stride_kct + hs[:, None] * stride_kch + offs[None, :]
        tl.store(dst_k, o1.to(K_CACHE.dtype.element_ty), mask=mask)
        tl.store(dst_k + HALF, o2.to(K_CACHE.dtype.element_ty), mask=mask)
        offs_d = tl.arange(0, BLOCK_D)
        mask_v = (hs[:, None] < HKV) & (offs_d[None, :] < D)
        v = tl.load(V + t * stride_vt + hs[:, None] * stride_vh + offs_d[None, :], mask=mask_v)
        dst_v = V_CACHE + page * stride_vcb + off * stride_vct + hs[:, None] * stride_vch + offs_d[None, :]
        tl.store(dst_v, v.to(V_CACHE.dtype.element_ty), mask=mask_v)


def qk_norm_rope_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_weight: torch.Tensor,
                       k_weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                       eps: float, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       slot_mapping: torch.Tensor) -> torch.Tensor:
    """`qk_norm_rope` then `triton_store.store_kv` of its k (and v), in ONE kernel launch, bitwise equal to the two.

    q `[T, Hq, D]`, k/v `[T, Hkv, D]` RAW (pre-norm; strided views with a contiguous last dim are fine),
    caches `[N, page, Hkv, D]`, slot_mapping int32/int64 `[n]` with n <= T. Returns the normalised and
    rotated q as a new contiguous `[T, Hq, D]` (every row, padding included). Normalised k row i is written
    to flat slot `slot_mapping[i]` of k_cache (cast to its dtype from the dtype `qk_norm_rope` returns k in)
    and v row i unchanged (cast) to v_cache; rows with slot < 0 or i >= n are not stored (k is not even
    computed for them). The grid depends on shapes only (no host reads): CUDA-graph capturable."""
    what = "qk_norm_rope_store"
    t, hq, hkv, d = _check_qk(what, q, k, q_weight, k_weight, cos, sin, positions)
    n = slot_mapping.shape[0]
    if slot_mapping.dim() != 1 or n > t or v.shape[0] < n:
        raise ValueError(f"{what}: {tuple(slot_mapping.shape)} slots for {t} q/k rows and {v.shape[0]} v rows")
    if v.dim() != 3 or tuple(v.shape[1:]) != (hkv, d):
        raise ValueError(f"{what}: v {tuple(v.shape)} must be [T, {hkv}, {d}] like k")
    if k_cache.dim() != 4 or tuple(k_cache.shape[2:]) != (hkv, d) or v_cache.shape != k_cache.shape:
        raise ValueError(f"{what}: caches {tuple(k_cache.shape)}, {tuple(v_cache.shape)} do not hold "
                         f"[{hkv}, {d}] rows")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError(f"{what}: caches must have a contiguous last dimension")
    k_dtype = torch.promote_types(k.dtype, k_weight.dtype)  # the dtype qk_norm_rope returns k in
    if k_dtype not in _TL_DTYPES:
        raise ValueError(f"{what}: unsupported k dtype {k_dtype}")
    if n == 0:  # nothing to store (and no slot storage to point the kernel at): the same q kernel alone
        return qk_norm_rope(q, k, q_weight, k_weight, cos, sin, positions, eps)[0]
    q, k, v = _last_dim_contiguous(q), _last_dim_contiguous(k), _last_dim_contiguous(v)
    cos, sin = _last_dim_contiguous(cos), _last_dim_contiguous(sin)
    q_weight, k_weight = q_weight.contiguous(), k_weight.contiguous()
    q_out = torch.empty((t, hq, d), dtype=torch.promote_types(q.dtype, q_weight.dtype), device=q.device)
    if hq + hkv == 0:
        return q_out
    half = d // 2
    block = triton.next_power_of_2(half)
    args = (q, k, v, q_out, q_weight, k_weight, cos, sin, positions, k_cache, v_cache, slot_mapping, n,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0), sin.stride(0),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
            v_cache.stride(2), eps)
    meta = dict(D=d, HALF=half, BLOCK=block, BLOCK_D=triton.next_power_of_2(d), PAGE=k_cache.shape[1],
                KO_TY=_TL_DTYPES[k_dtype])
    if _use_token_kernel(t, hq, block):  # same variant as qk_norm_rope: same reductions, same bits
        _qk_norm_rope_store_token_kernel[(t,)](
            *args, HQ=hq, HKV=hkv, HQB=triton.next_power_of_2(hq), HKB=triton.next_power_of_2(hkv), **meta,
            num_warps=4,
        )
    else:
        _qk_norm_rope_store_kernel[(t, hq + hkv)](
            *args, HQ=hq, HKV=hkv, **meta, num_warps=max(1, min(4, block // 64)),
        )
    return q_out


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
