"""The q/k prologue of the decode attention kernel: per-head RMSNorm + neox rotary of the raw q and k, and the KV
store of the new token, run inside `triton_decode._decode_split_kernel` (QK_FUSED) instead of a kernel of its own.

This is `triton_rope.qk_norm_rope_store` moved into the split kernel, one launch fewer per layer. Numerics follow
`_norm_rope_head_values` (fp32 math; the normalised value rounded to the input dtype, times the weight rounded to
the output dtype; cos/sin cast to the output dtype; each rotary product and the sum rounded), written over the
whole head at once: lane d's rotate-half partner is d + D/2 (first half, negated) or d - D/2. The sum of squares
is one reduction over the head instead of two half sums, so a norm may differ from the unfused kernel's in its
last fp32 bit (rarely visible after rounding); tests pin the fused path close to the unfused one.

Host side: `DecodeQK` carries the raw k/v, the norm weights, the rotary tables, positions and slots;
`fusable` says whether a call can take the fused kernel (one dtype throughout, unit last strides, every stored row
among the decode rows). Triton- and torch-only; imported by `triton_decode` (no cycle: nothing here imports it).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton.language as tl
import triton


class DecodeQK(NamedTuple):
    """The raw-q decode call's prologue (`QKPrologue` plus the new token's k/v and slots).

    k, v: raw (pre-norm) `[B, Hkv, D]`, unit last stride (column views of the fused qkv output are fine);
    q_weight, k_weight: `[D]` norm weights; cos, sin: fp32 `[max_pos, D]`; positions int `[>= B]`;
    slot_mapping int32/int64 `[n <= B]`: flat cache slot of row i's new token (< 0: not stored); eps: the norm's.
    """

    k: torch.Tensor
    v: torch.Tensor
    q_weight: torch.Tensor
    k_weight: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    eps: float


def fusable(q: torch.Tensor, qk: DecodeQK, k_cache: torch.Tensor) -> bool:
    """Whether raw q `[B, Hq, D]` with `qk` can take the fused kernel: q, k, v, both weights and the caches of one
    dtype (so the prologue's rounding is the unfused one's), unit last strides, `[B, Hkv, D]` k/v, positions for
    every row, and no stored row past B (the fused kernel stores rows of the decode grid only)."""
    b, _, d = q.shape
    tensors = (q, qk.k, qk.v, qk.q_weight, qk.k_weight, k_cache)
    return (len({t.dtype for t in tensors}) == 1 and all(t.stride(-1) == 1 for t in (q, qk.k, qk.v, qk.cos, qk.sin))
            and qk.k.dim() == 3 and tuple(qk.k.shape) == (b, k_cache.shape[2], d) and qk.v.shape == qk.k.shape
            and qk.q_weight.shape == (d,) and qk.k_weight.shape == (d,) and qk.cos.shape[-1] == d
            and qk.sin.shape[-1] == d and d % 2 == 0 and qk.positions.shape[0] >= b
            and qk.slot_mapping.dim() == 1 and qk.slot_mapping.shape[0] <= b)


@triton.jit
def _norm_rope_rows(X, W, COS, SIN, x_rows, pos, stride_cos, stride_sin, eps, offs_d, mask,
                    D: tl.constexpr, HALF: tl.constexpr, OUT_TY: tl.constexpr):
    """Heads at row offsets x_rows `[R, 1]` of X, normalised and rotated at position `pos`: `[R, BLOCK_D]` OUT_TY
    (masked lanes 0). mask `[R, BLOCK_D]`: live heads x lanes < D."""
    lane = offs_d < D
    partner = tl.where(offs_d < HALF, offs_d + HALF, offs_d - HALF)
    x = tl.load(X + x_rows + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    xp = tl.load(X + x_rows + partner[None, :], mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)[:, None]
    in_ty = X.dtype.element_ty
    w = tl.load(W + offs_d, mask=lane, other=0.0).to(tl.float32)[None, :]
    wp = tl.load(W + partner, mask=lane, other=0.0).to(tl.float32)[None, :]
    y = ((x * rstd).to(in_ty).to(tl.float32) * w).to(OUT_TY).to(tl.float32)
    yp = ((xp * rstd).to(in_ty).to(tl.float32) * wp).to(OUT_TY).to(tl.float32)
    c = tl.load(COS + pos * stride_cos + offs_d, mask=lane, other=0.0).to(OUT_TY).to(tl.float32)[None, :]
    s = tl.load(SIN + pos * stride_sin + offs_d, mask=lane, other=0.0).to(OUT_TY).to(tl.float32)[None, :]
    rot = tl.where((offs_d < HALF)[None, :], -yp, yp)  # rotate_half(y) = cat(-y2, y1)
    o = (y * c).to(OUT_TY).to(tl.float32) + (rot * s).to(OUT_TY).to(tl.float32)
    return tl.where(mask, o, 0.0).to(OUT_TY)


@triton.jit
def _prologue(Q, K_NEW, V_NEW, QW, KW, COS, SIN, POS, SLOTS, K_CACHE, V_CACHE, b, kvh, heads, g_mask, offs_d,
              d_mask, n_slots, stride_qb, stride_qh, stride_knb, stride_knh, stride_vnb, stride_vnh, stride_cos,
              stride_sin, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, eps,
              HEAD_DIM: tl.constexpr, HALF: tl.constexpr, PAGE: tl.constexpr):
    """Program (b, kvh)'s normalised, rotated q rows `[BLOCK_G, BLOCK_D]` (Q's dtype), after storing row b's new k
    (normalised, rotated, rounded to K_NEW's dtype) and v for KV head kvh at slot SLOTS[b] (none for slot < 0 or
    b >= n_slots). Every program of (b, kvh) stores the same bits and then waits at a CTA barrier, so its own reads
    of the caches see the row whichever tile holds it."""
    pos = tl.load(POS + b).to(tl.int64)
    q_rows = b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh
    q = _norm_rope_rows(Q, QW, COS, SIN, q_rows, pos, stride_cos, stride_sin, eps, offs_d,
                        g_mask[:, None] & d_mask[None, :], HEAD_DIM, HALF, Q.dtype.element_ty)
    slot = tl.load(SLOTS + b, mask=b < n_slots, other=-1).to(tl.int64)
    if slot >= 0:
        one = tl.zeros([1], dtype=tl.int64)[:, None]
        k_mask = (one == 0) & d_mask[None, :]
        k = _norm_rope_rows(K_NEW, KW, COS, SIN, one + b.to(tl.int64) * stride_knb + kvh * stride_knh, pos,
                            stride_cos, stride_sin, eps, offs_d, k_mask, HEAD_DIM, HALF, K_NEW.dtype.element_ty)
        v = tl.load(V_NEW + one + b.to(tl.int64) * stride_vnb + kvh * stride_vnh + offs_d[None, :], mask=k_mask)
        page = slot // PAGE
        row = slot % PAGE
        tl.store(K_CACHE + one + page * stride_kb + row * stride_kt + kvh * stride_kh + offs_d[None, :],
                 k.to(K_CACHE.dtype.element_ty), mask=k_mask)
        tl.store(V_CACHE + one + page * stride_vb + row * stride_vt + kvh * stride_vh + offs_d[None, :],
                 v.to(V_CACHE.dtype.element_ty), mask=k_mask)
    tl.debug_barrier()
    return q
