"""The routed experts of a few tokens, pair by pair: two launches, the weighted combine fused into the second.

For a decode step of T tokens at top-k (T * k pairs, a handful of experts each holding one or two rows), the
grouped path of `triton_moe` spends four launches (grouping, gate/up GEMM, down GEMM, combine) on a problem that
is pure weight streaming. Here a pair needs no grouping: its program reads the expert id itself.

1. `_pair13_kernel` (grid: pairs x I tiles): program (p, i) reads expert ids[p], multiplies token p // k's row of x
   by BLOCK_N gate rows and the matching up rows of w13[e] (a GEMV: no tensor cores, fp32 sums over K) and writes
   silu(gate) * up `[BLOCK_N]` of pair p's activation row. Pairs routed elsewhere (id -1, other EP ranks' experts)
   write nothing.
2. `_pair2_kernel` (grid: tokens x H tiles): program (t, h) runs the down projection of each of token t's k pairs
   over its BLOCK_N output columns (w2[e] rows), rounds it, and adds it times the pair's weight in fp32, in slot
   order; it writes the token's output once. Deterministic, no atomics, nothing else reads the pairs' outputs.

Numerics are `modeling.ops.moe_ref`'s (and the grouped path's) rounding points: gate and up rounded to the
activation dtype, silu rounded, times up rounded; the down projection rounded; the weighted sum in fp32, rounded
once. Only the order of the fp32 sums over K differs.

A token's pairs that share an expert read its weights once each (from L2 the second time), which is why
`routed_experts` takes this path only up to `KernelOptions.moe_pair_max_tokens` tokens. Both kernels wait for
the previous kernel (PDL) before their first load: which weights they read depends on the routing. Grids depend
on shapes only, nothing is read on the host: capturable at any bucket. Launch on the current stream; outputs are
new tensors from the caching allocator.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from modeling.ops.pdl import PDL_LAUNCH, pdl_launch_dependents, pdl_wait


@dataclass(frozen=True)
class PairConfig:
    """Launch parameters of the two pair kernels: output rows per program and the K chunk of each GEMV."""

    block_n13: int
    block_k13: int
    block_n2: int
    block_k2: int
    num_warps: int = 4


def pair_config(tokens: int, top_k: int, inter: int, hidden: int) -> PairConfig:
    """Enough programs to fill the GPU at one token (tokens * k * I / block_n13 and tokens * H / block_n2 in the
    hundreds), whole K in few chunks."""
    block_n2 = 8 if tokens <= 2 else 16
    return PairConfig(block_n13=16, block_k13=min(512, triton.next_power_of_2(hidden)), block_n2=block_n2,
                      block_k2=min(256, triton.next_power_of_2(inter)))


@triton.jit
def _local_expert(IDS, pair, first_expert, e_local):
    """(local expert index, whether pair `pair` is routed to a local expert)."""
    e = tl.load(IDS + pair)
    local = e - first_expert
    return local, (e >= 0) & (local >= 0) & (local < e_local)


@triton.jit
def _spread(valid, offs):
    """The scalar `valid` as a mask shaped like `offs` (masks must be tensors)."""
    return (offs * 0 + valid.to(tl.int32)) > 0


@triton.jit
def _pair13_kernel(X, IDS, W13, ACT, first_expert, e_local, I, K, stride_xm, stride_we, stride_wn, stride_am,
                   TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    pdl_launch_dependents(PDL)
    pdl_wait(PDL)
    pair = tl.program_id(0)
    local, valid = _local_expert(IDS, pair, first_expert, e_local)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = (offs_n < I) & _spread(valid, offs_n)
    offs_k = tl.arange(0, BLOCK_K)
    k_live = _spread(valid, offs_k)
    x_row = X + (pair // TOP_K).to(tl.int64) * stride_xm
    g_rows = W13 + tl.where(valid, local, 0).to(tl.int64) * stride_we + offs_n.to(tl.int64)[:, None] * stride_wn
    u_rows = g_rows + I * stride_wn
    acc_g = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = offs_k + k0 < K
        w_mask = n_mask[:, None] & k_mask[None, :]
        x = tl.load(x_row + k0 + offs_k, mask=k_mask & k_live, other=0.0).to(tl.float32)[None, :]
        acc_g += tl.load(g_rows + k0 + offs_k[None, :], mask=w_mask, other=0.0).to(tl.float32) * x
        acc_u += tl.load(u_rows + k0 + offs_k[None, :], mask=w_mask, other=0.0).to(tl.float32) * x
    dt = ACT.dtype.element_ty
    g = tl.sum(acc_g, axis=1).to(dt).to(tl.float32)
    u = tl.sum(acc_u, axis=1).to(dt).to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
    tl.store(ACT + pair.to(tl.int64) * stride_am + offs_n, (act * u).to(dt), mask=n_mask)


@triton.jit
def _pair2_kernel(ACT, IDS, WEIGHTS, W2, OUT, first_expert, e_local, H, I, stride_am, stride_we, stride_wn,
                  stride_om, TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    pdl_launch_dependents(PDL)
    pdl_wait(PDL)
    t = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    h_mask = offs_n < H
    offs_k = tl.arange(0, BLOCK_K)
    dt = OUT.dtype.element_ty
    out = tl.zeros([BLOCK_N], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        pair = t * TOP_K + j
        local, valid = _local_expert(IDS, pair, first_expert, e_local)
        n_mask = h_mask & _spread(valid, offs_n)
        k_live = _spread(valid, offs_k)
        a_row = ACT + pair.to(tl.int64) * stride_am
        w_rows = W2 + tl.where(valid, local, 0).to(tl.int64) * stride_we + offs_n.to(tl.int64)[:, None] * stride_wn
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        for k0 in range(0, I, BLOCK_K):
            k_mask = offs_k + k0 < I
            a = tl.load(a_row + k0 + offs_k, mask=k_mask & k_live, other=0.0).to(tl.float32)[None, :]
            w = tl.load(w_rows + k0 + offs_k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
            acc += w.to(tl.float32) * a
        y = tl.sum(acc, axis=1).to(dt).to(tl.float32)
        weight = tl.load(WEIGHTS + pair)
        out += tl.where(valid, weight, 0.0) * y
    tl.store(OUT + t.to(tl.int64) * stride_om + offs_n, out.to(dt), mask=h_mask)


def pair_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                 first_expert: int, *, pdl: int = 0, config: PairConfig | None = None) -> torch.Tensor:
    """`triton_moe.routed_experts` in two launches, for inputs it has already checked: x `[N, H]` (unit last
    stride), ids int64 `[N, k]` and weights fp32 `[N, k]` contiguous, w13 `[E_local, 2I, H]`, w2 `[E_local, H, I]`
    (unit last strides), N >= 1. Returns `[N, H]` in x's dtype. `pdl`: the PDL mode both kernels launch with
    (`modeling.ops.pdl`)."""
    n, k = ids.shape
    e_local, h, inter = w2.shape
    cfg = config or pair_config(n, k, inter, h)
    act = torch.empty((n * k, inter), dtype=x.dtype, device=x.device)
    out = torch.empty((n, h), dtype=x.dtype, device=x.device)
    _pair13_kernel[(n * k, triton.cdiv(inter, cfg.block_n13))](
        x, ids, w13, act, first_expert, e_local, inter, h, x.stride(0), w13.stride(0), w13.stride(1), act.stride(0),
        TOP_K=k, BLOCK_N=cfg.block_n13, BLOCK_K=cfg.block_k13, num_warps=cfg.num_warps, **PDL_LAUNCH[pdl])
    _pair2_kernel[(n, triton.cdiv(h, cfg.block_n2))](
        act, ids, weights, w2, out, first_expert, e_local, h, inter, act.stride(0), w2.stride(0), w2.stride(1),
        out.stride(0), TOP_K=k, BLOCK_N=cfg.block_n2, BLOCK_K=cfg.block_k2, num_warps=cfg.num_warps,
        **PDL_LAUNCH[pdl])
    return out
