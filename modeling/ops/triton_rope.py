"""Triton per-head q/k RMSNorm + neox rotary (`qk_norm_rope`), alone or fused with the paged KV store
(`qk_norm_rope_store`). Same signatures and numerics as `fused_ref.py`; re-exported by `triton_fused`.

Numerics: per-head rms_norm as in `triton_fused` (fp32 math, rounded to the activation dtype), then
`q*c + rotate_half(q)*s` with c/s cast to the activation dtype and each product and the sum rounded to
that dtype, as torch does. `qk_norm_rope_store` is `qk_norm_rope` followed by `triton_store.store_kv`
of its k (and v) in one kernel: the same variant (per head or per token, picked by `_use_token_kernel`),
the same code (`_norm_rope_head[s]_values`) and k rounded to the dtype `qk_norm_rope` returns before
the cast to the cache dtype, so q, the cache rows and the skipped rows are bitwise those of the two
kernels. Each public function is one kernel launch with a static grid (CUDA-graph capturable); q/k may
be strided column views of a fused qkv output (unit last stride); outputs are new contiguous tensors.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from modeling.ops.pdl import PDL_LAUNCH, pdl_launch_dependents, pdl_wait
from modeling.ops.triton_store import _last_dim_contiguous


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
def _rope_offsets(POS, t, stride_cos, stride_sin):
    """Offsets of token t's rows in the cos and sin tables (its position read from POS)."""
    pos = tl.load(POS + t).to(tl.int64)
    return pos * stride_cos, pos * stride_sin


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
    cos_off, sin_off = _rope_offsets(POS, t, stride_cos, stride_sin)
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
    cos_off, sin_off = _rope_offsets(POS, t, stride_cos, stride_sin)
    _norm_rope_heads(Q, QO, QW, COS, SIN, t * stride_qt, stride_qh, t * HQ * D, cos_off, sin_off, eps,
                     HQ, HQB, D, HALF, BLOCK)
    _norm_rope_heads(K, KO, KW, COS, SIN, t * stride_kt, stride_kh, t * HKV * D, cos_off, sin_off, eps,
                     HKV, HKB, D, HALF, BLOCK)


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


# the token count and where the positions and slots live vary per step: no recompiles
@triton.jit(do_not_specialize=["n_slots"], do_not_specialize_on_alignment=["POS", "SLOTS"])
def _qk_norm_rope_store_kernel(
    Q, K, V, QO, QW, KW, COS, SIN, POS, K_CACHE, V_CACHE, SLOTS, n_slots,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_cos, stride_sin,
    stride_kcb, stride_kct, stride_kch, stride_vcb, stride_vct, stride_vch, eps,
    HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr, BLOCK: tl.constexpr,
    BLOCK_D: tl.constexpr, PAGE: tl.constexpr, KO_TY: tl.constexpr, PDL: tl.constexpr,
):
    """Grid (T, HQ + HKV) like `_qk_norm_rope_kernel`: q heads go to QO; k head hk of a stored row goes to
    K_CACHE (rounded to KO_TY, the dtype `qk_norm_rope` returns k in, then to the cache's) with v head hk."""
    pdl_launch_dependents(PDL)
    pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    cos_off, sin_off = _rope_offsets(POS, t, stride_cos, stride_sin)
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


@triton.jit(do_not_specialize=["n_slots"], do_not_specialize_on_alignment=["POS", "SLOTS"])
def _qk_norm_rope_store_token_kernel(
    Q, K, V, QO, QW, KW, COS, SIN, POS, K_CACHE, V_CACHE, SLOTS, n_slots,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_cos, stride_sin,
    stride_kcb, stride_kct, stride_kch, stride_vcb, stride_vct, stride_vch, eps,
    HQ: tl.constexpr, HKV: tl.constexpr, HQB: tl.constexpr, HKB: tl.constexpr, D: tl.constexpr,
    HALF: tl.constexpr, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr, KO_TY: tl.constexpr,
    PDL: tl.constexpr,
):
    """Grid (T,) like `_qk_norm_rope_token_kernel`: all q heads to QO; all k and v heads of a stored row to the
    caches."""
    pdl_launch_dependents(PDL)
    pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    cos_off, sin_off = _rope_offsets(POS, t, stride_cos, stride_sin)
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
                       slot_mapping: torch.Tensor, *, pdl: int = 0) -> torch.Tensor:
    """`qk_norm_rope` then `triton_store.store_kv` of its k (and v), in ONE kernel launch, bitwise equal to the two.

    q `[T, Hq, D]`, k/v `[T, Hkv, D]` RAW (pre-norm; strided views with a contiguous last dim are fine),
    caches `[N, page, Hkv, D]`, slot_mapping int32/int64 `[n]` with n <= T. Returns the normalised and
    rotated q as a new contiguous `[T, Hq, D]` (every row, padding included). Normalised k row i is written
    to flat slot `slot_mapping[i]` of k_cache (cast to its dtype from the dtype `qk_norm_rope` returns k in)
    and v row i unchanged (cast) to v_cache; rows with slot < 0 or i >= n are not stored (k is not even
    computed for them). The grid depends on shapes only (no host reads): CUDA-graph capturable. `pdl`: the launch's
    PDL mode (`modeling.ops.pdl`)."""
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
                KO_TY=_TL_DTYPES[k_dtype], **PDL_LAUNCH[pdl])
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
