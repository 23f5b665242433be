"""Routed experts pair by pair for the smallest decode steps: no grouping launch, the combine inside the down GEMM.

At one or two tokens every (token, slot) pair is its own row: grouping the pairs by expert (`triton_moe`'s counting
sort), mapping row tiles to experts from the counts, and a separate combine launch cost more than they save. Up to
`pairs_max` pairs (`routed_experts_by_size`; `KernelOptions.moe_pairs_max`) two launches replace the four of
`triton_moe.routed_experts` (scatter, gate/up GEMM, down GEMM, combine):

1. `_pair_gate_up_kernel` (grid: P pairs x I tiles): program (p, t) reads expert ids[p] (a pair routed to no local
   expert exits), x row p // k and the gate and up rows of its I tile, and writes silu(gate) * up to act[p, tile].
2. `_pair_down_combine_kernel` (grid: N tokens x H tiles): the token's k pairs as the batch of a batched `tl.dot`
   (pair j's act row times w2[ids[j]]'s H tile, all k pairs' weights in flight at once), one loop over the I
   chunks; each pair's down projection is rounded to the dtype, weighted and summed in fp32 in slot order; out[n,
   tile] is written once. (One flat loop over pairs x I chunks with a 2-D dot, a pair at a time, measured 1.4x
   slower: docs/benchmarks.md, twenty-eighth session.)

All multiply a 16-row tile whose row 0 is the pair (the other rows masked to zero) with `tl.dot`, in the K order
of `triton_moe`'s grouped GEMMs, and round as they do (the gate/up tile is theirs: `triton_moe.swiglu_tile`), so a
step gives the same bits on either path (the GPU tests pin this). Grids depend on shapes only, nothing is read on
the host: capturable at every size. Shapes and dtypes are `triton_moe.routed_experts`'s; launched on the current
stream with PDL mode `pdl` (each kernel triggers its dependents first and waits before its first load). Lifetime:
act and the output are new tensors from the caching allocator (graph-pool memory under capture).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from modeling.ops import triton_moe
from modeling.ops.pdl import PDL_LAUNCH, pdl_launch_dependents, pdl_wait
from modeling.ops.triton_moe import MoeGemmConfig, MoeKernelError, swiglu_tile

PAIR_ROWS = 16  # the row tile of tl.dot; row 0 is the pair


def pair_configs(dtype: torch.dtype) -> tuple[MoeGemmConfig, MoeGemmConfig]:
    """(gate/up, down) launch configs: narrow tiles so one or two tokens still fill the GPU."""
    if dtype == torch.float32:
        return MoeGemmConfig(PAIR_ROWS, 32, 32, 4, 2), MoeGemmConfig(PAIR_ROWS, 32, 32, 4, 2)
    return MoeGemmConfig(PAIR_ROWS, 32, 128, 4, 4), MoeGemmConfig(PAIR_ROWS, 16, 64, 4, 4)


@triton.jit
def _pair_gate_up_kernel(X, IDS, W13, ACT, first_expert, e_local, I, K, stride_xm, stride_we, stride_wn, stride_am,
                         TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         PRECISION: tl.constexpr, PDL: tl.constexpr):
    pdl_launch_dependents(PDL)
    p = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    row0 = offs_m == 0
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < I
    offs_k = tl.arange(0, BLOCK_K)
    pdl_wait(PDL)  # the ids come from this step's router: nothing loads before it
    e = tl.load(IDS + p)
    expert = e - first_expert
    if (e < 0) | (expert < 0) | (expert >= e_local):
        return
    x_ptrs = X + (p // TOP_K).to(tl.int64) * stride_xm + offs_m[:, None] * 0 + offs_k[None, :]
    g_ptrs = W13 + expert.to(tl.int64) * stride_we + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
    out = swiglu_tile(x_ptrs, row0, g_ptrs, g_ptrs + I * stride_wn, n_mask, offs_k, K, ACT.dtype.element_ty,
                      BLOCK_M, BLOCK_N, BLOCK_K, PRECISION)
    tl.store(ACT + p.to(tl.int64) * stride_am + offs_m[:, None] * 0 + offs_n[None, :], out,
             mask=row0[:, None] & n_mask[None, :])


@triton.jit
def _pair_down_combine_kernel(ACT, IDS, WTS, W2, OUT, first_expert, e_local, H, K, stride_am, stride_we, stride_wn,
                              TOP_K: tl.constexpr, K_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                              BLOCK_K: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr):
    pdl_launch_dependents(PDL)
    n = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    row0 = (offs_m == 0)[None, :, None]
    offs_h = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    h_mask = offs_h < H
    offs_k = tl.arange(0, BLOCK_K)
    offs_j = tl.arange(0, K_PAD)
    pdl_wait(PDL)
    ids = tl.load(IDS + n * TOP_K + offs_j, mask=offs_j < TOP_K, other=-1)
    local = ids - first_expert
    valid = (offs_j < TOP_K) & (ids >= 0) & (local >= 0) & (local < e_local)
    local = tl.where(valid, local, 0)
    wts = tl.where(valid, tl.load(WTS + n * TOP_K + offs_j, mask=offs_j < TOP_K, other=0.0), 0.0)
    live = valid.to(tl.int32)[:, None, None]  # a pair on no local expert loads nothing (row masks only)
    a_ptrs = (ACT + (n * TOP_K + offs_j).to(tl.int64)[:, None, None] * stride_am + offs_m[None, :, None] * 0
              + offs_k[None, None, :])
    w_ptrs = (W2 + local.to(tl.int64)[:, None, None] * stride_we + offs_k[None, :, None]
              + offs_h.to(tl.int64)[None, None, :] * stride_wn)
    acc = tl.zeros([K_PAD, BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a = tl.load(a_ptrs + k0, mask=(offs_m[None, :, None] < live) & (offs_k[None, None, :] + k0 < K), other=0.0)
        w = tl.load(w_ptrs + k0, mask=(offs_k[None, :, None] + k0 < K) & (offs_h[None, None, :] < H * live),
                    other=0.0)
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
    dt = OUT.dtype.element_ty
    y = tl.sum(tl.where(row0, acc, 0.0), axis=1).to(dt).to(tl.float32)  # [K_PAD, BLOCK_N]: row 0 of each pair
    out = tl.zeros([BLOCK_N], dtype=tl.float32)
    for j in tl.static_range(TOP_K):  # slot order, as the grouped path's combine
        mine = offs_j == j
        out += tl.sum(tl.where(mine, wts, 0.0), axis=0) * tl.sum(tl.where(mine[:, None], y, 0.0), axis=0)
    tl.store(OUT + n.to(tl.int64) * H + offs_h, out.to(dt), mask=h_mask)


def pair_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                 first_expert: int = 0, *, configs: tuple[MoeGemmConfig, MoeGemmConfig] | None = None,
                 pdl: int = 0) -> torch.Tensor:
    """`triton_moe.routed_experts` pair by pair (same arguments, result and bits): two launches, for small N * k."""
    n, k = triton_moe.check_routed(x, ids, weights)
    e_local, h, inter = triton_moe.check_weights(x, w13, w2)
    out = torch.empty((n, h), dtype=x.dtype, device=x.device)
    if n == 0:
        return out
    ids, weights = ids.contiguous(), weights.contiguous()
    dt = x.dtype
    prec = "ieee" if dt == torch.float32 else "tf32"
    c1, c2 = configs or pair_configs(dt)
    if c1.block_m != PAIR_ROWS or c2.block_m != PAIR_ROWS:
        raise MoeKernelError(f"pair configs need block_m={PAIR_ROWS}, got {c1.block_m} / {c2.block_m}")
    act = torch.empty((n * k, inter), dtype=dt, device=x.device)
    _pair_gate_up_kernel[(n * k, triton.cdiv(inter, c1.block_n))](
        x, ids, w13, act, first_expert, e_local, inter, h, x.stride(0), w13.stride(0), w13.stride(1), act.stride(0),
        TOP_K=k, BLOCK_M=PAIR_ROWS, BLOCK_N=c1.block_n, BLOCK_K=c1.block_k, PRECISION=prec,
        num_warps=c1.num_warps, num_stages=c1.num_stages, **PDL_LAUNCH[pdl])
    _pair_down_combine_kernel[(n, triton.cdiv(h, c2.block_n))](
        act, ids, weights, w2, out, first_expert, e_local, h, inter, act.stride(0), w2.stride(0), w2.stride(1),
        TOP_K=k, K_PAD=triton.next_power_of_2(k), BLOCK_M=PAIR_ROWS, BLOCK_N=c2.block_n, BLOCK_K=c2.block_k,
        PRECISION=prec, num_warps=c2.num_warps, num_stages=c2.num_stages, **PDL_LAUNCH[pdl])
    return out


def routed_experts_by_size(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor,
                           w2: torch.Tensor, first_expert: int = 0, *, pairs_max: int = 0,
                           pdl: int = 0) -> torch.Tensor:
    """`pair_experts` up to `pairs_max` (token, slot) pairs (N * k; 0: never), else `triton_moe.routed_experts`.
    The choice depends on shapes only, so one captured graph per size keeps its path."""
    if 0 < ids.numel() <= pairs_max:
        return pair_experts(x, ids, weights, w13, w2, first_expert, pdl=pdl)
    return triton_moe.routed_experts(x, ids, weights, w13, w2, first_expert, pdl=pdl)
