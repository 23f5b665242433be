"""Skinny GEMM for decode: y `[M, N]` = x `[M, K]` @ w `[N, K]`^T for small M (<= 16).

At batch 1..16 a decode step is a weight-streaming problem; cuBLAS picks small-tile
kernels that reach a fraction of HBM bandwidth there. This kernel gives each program
BLOCK_N output columns for all M rows and streams its weight rows in deep K chunks.
Static grid (N / BLOCK_N), no host sync: capturable. Larger M falls back to `F.linear`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

SKINNY_MAX_M = 16


@triton.jit
def _skinny_gemm_kernel(X, W, Y, M, N, K, stride_xm, stride_wn, stride_ym,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    pid = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        if EVEN_K:
            x = tl.load(X + offs_m[:, None] * stride_xm + offs_k[None, :], mask=m_mask[:, None], other=0.0)
            w = tl.load(W + offs_n[:, None] * stride_wn + offs_k[None, :], mask=n_mask[:, None], other=0.0)
        else:
            k_mask = offs_k < K
            x = tl.load(X + offs_m[:, None] * stride_xm + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :],
                        other=0.0)
            w = tl.load(W + offs_n[:, None] * stride_wn + offs_k[None, :], mask=n_mask[:, None] & k_mask[None, :],
                        other=0.0)
        acc += tl.dot(x, tl.trans(w))
    tl.store(Y + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(Y.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`F.linear(x, weight)` for x `[..., K]`, weight `[N, K]`; the Triton path when rows <= SKINNY_MAX_M."""
    if x.dim() != 2 or x.shape[0] > SKINNY_MAX_M or x.dtype == torch.float32 or not x.is_cuda:
        return F.linear(x, weight)
    m, k = x.shape
    n = weight.shape[0]
    if x.stride(1) != 1:
        x = x.contiguous()
    if weight.stride(1) != 1:
        return F.linear(x, weight)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    # shared memory per stage = (BLOCK_M + BLOCK_N) * BLOCK_K * 2 bytes; stay well under 227 KiB
    block_n, block_k, stages = (16, 512, 4) if n <= 8192 else (64, 256, 3)
    if k % block_k:
        block_k = 256
    grid = (triton.cdiv(n, block_n),)
    _skinny_gemm_kernel[grid](x, weight, y, m, n, k, x.stride(0), weight.stride(0), y.stride(0),
                              BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=(k % block_k == 0),
                              num_warps=4, num_stages=stages)
    return y
