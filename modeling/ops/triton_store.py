"""Triton KV store: scatter new K/V rows into the paged cache.

Shapes: k/v `[T, Hkv, D]` (last dim contiguous, any dtype castable to the
cache's), caches `[N, bs, Hkv, D]` (bf16, fp16 or fp32), slot_mapping int32 or
int64 `[n]` with n <= T. Row i goes to flat slot `slot_mapping[i]`
(block = slot // bs, offset = slot % bs); rows with slot < 0 and rows i >= n
(bucket padding) are skipped. The grid is `(n,)`, a static fact of the tensor
shape, and the slot is read on the device: safe inside CUDA graph capture.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kv_kernel(
    K,
    V,
    K_CACHE,
    V_CACHE,
    SLOTS,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcb,
    stride_kct,
    stride_kch,
    stride_vcb,
    stride_vct,
    stride_vch,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    row = tl.program_id(0)
    slot = tl.load(SLOTS + row).to(tl.int64)
    if slot < 0:
        return
    page = slot // PAGE
    off = slot % PAGE
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < NUM_HEADS) & (offs_d[None, :] < HEAD_DIM)
    src_row = row.to(tl.int64)

    k = tl.load(K + src_row * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    dst_k = K_CACHE + page * stride_kcb + off * stride_kct + offs_h[:, None] * stride_kch + offs_d[None, :]
    tl.store(dst_k, k.to(K_CACHE.dtype.element_ty), mask=mask)

    v = tl.load(V + src_row * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    dst_v = V_CACHE + page * stride_vcb + off * stride_vct + offs_h[:, None] * stride_vch + offs_d[None, :]
    tl.store(dst_v, v.to(V_CACHE.dtype.element_ty), mask=mask)


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def store_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write row i of k/v to flat slot `slot_mapping[i]`; rows with slot < 0 or i >= len(slot_mapping) are skipped."""
    n = slot_mapping.shape[0]
    if n == 0:
        return
    if k.shape[0] < n or v.shape[0] < n:
        raise ValueError(f"store_kv: {n} slots for only {k.shape[0]} rows")
    if k.shape[1:] != k_cache.shape[2:] or v.shape[1:] != v_cache.shape[2:]:
        raise ValueError(f"store_kv: rows {tuple(k.shape[1:])} do not match cache rows {tuple(k_cache.shape[2:])}")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("store_kv: caches must have a contiguous last dimension")
    k, v = _last_dim_contiguous(k), _last_dim_contiguous(v)
    num_heads, head_dim = k.shape[1], k.shape[2]
    block_h = triton.next_power_of_2(num_heads)
    block_d = triton.next_power_of_2(head_dim)
    _store_kv_kernel[(n,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        NUM_HEADS=num_heads,
        HEAD_DIM=head_dim,
        PAGE=k_cache.shape[1],
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        num_warps=max(1, min(8, block_h * block_d // 256)),
    )
