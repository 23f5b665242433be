"""A MoE block's routing and expert grouping in one launch, for small decode steps (no dispatcher).

At a decode step of a few tokens the routed-expert path runs the router's top-k (`triton_router`), then the grouping
of the N * k (token, slot) pairs by expert (`triton_moe.group_by_expert`), each one small program. Where one
routing program holds every row (`triton_router.rows_per_program`: up to 1024 logits, 8 rows of 128 experts) and one
grouping chunk every pair, `_route_group_kernel` does both: the softmax, top-k and renormalisation of
`triton_router._route_rows` (the same code and warps, so the same bits), then the counting sort of
`triton_moe._store_sorted` over the pairs still in registers. Larger steps take the two launches. Either way the
grouped GEMMs and the combine follow (`triton_moe.grouped_experts`).

Shapes and dtypes: x `[N, H]`, router_logits `[N, E]` (bf16, fp16 or fp32), w13 `[E, 2I, H]`, w2 `[E, H, I]`: every
expert local (no EP: the TP ranks' slices of the intermediate dim); returns `[N, H]` in x's dtype. Grids depend on
shapes only, nothing is read on the host: capturable. Launched on the current stream with PDL mode `pdl`
(`modeling.ops.pdl`); the fused program waits before its first load. Lifetime: outputs and scratch are new tensors
from the caching allocator (graph-pool memory under capture).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from modeling.ops.pdl import PDL_LAUNCH, pdl_launch_dependents, pdl_wait
from modeling.ops.triton_moe import _BLOCK_P, _block_e, _check_weights, _store_sorted, grouped_experts, group_by_expert
from modeling.ops.triton_router import MAX_EXPERTS, _route_rows, route_topk, route_warps, rows_per_program


@triton.jit(do_not_specialize=["N"])
def _route_group_kernel(L, W, I, SORTED, COUNTS, N, E, stride_l, K: tl.constexpr, R: tl.constexpr,
                        E_PAD: tl.constexpr, K_PAD: tl.constexpr, RENORM: tl.constexpr, BLOCK_E: tl.constexpr,
                        PDL: tl.constexpr):
    """One program: rows 0..N-1 (N <= R) of L `[N, E]` routed into W / I `[N, K]`, then their pairs n * K + j grouped
    by expert: COUNTS `[E]` int32 and SORTED `[N * K]` int32 (pair indices in expert order, pair order within)."""
    pdl_launch_dependents(PDL)
    rows = tl.arange(0, R).to(tl.int64)
    pdl_wait(PDL)
    ids, stored = _route_rows(L, W, I, rows, N, E, stride_l, K, E_PAD, K_PAD, RENORM)
    pairs = rows[:, None] * K + tl.arange(0, K_PAD)[None, :]
    # row-major flattening keeps the pairs in pair order (the stored ones: slots j < K of rows n < N)
    local = tl.reshape(tl.where(stored, ids, -1).to(tl.int32), [R * K_PAD])
    pairs = tl.reshape(pairs.to(tl.int32), [R * K_PAD])
    valid = tl.reshape(stored, [R * K_PAD])
    offs_e = tl.arange(0, BLOCK_E)
    onehot = (local[:, None] == offs_e[None, :]).to(tl.int32)
    total = tl.sum(onehot, axis=0)
    tl.store(COUNTS + offs_e, total, mask=offs_e < E)
    _store_sorted(SORTED, onehot, tl.cumsum(total, axis=0) - total, pairs, valid)


def fused_route_group_applies(n: int, num_experts: int, top_k: int) -> bool:
    """Whether one `_route_group_kernel` program routes and groups an n-token step: one routing program's rows
    and one grouping chunk's pairs."""
    e_pad = triton.next_power_of_2(num_experts)
    return 0 < n <= rows_per_program(n, e_pad) and n * top_k <= _BLOCK_P and num_experts <= MAX_EXPERTS


def route_and_group(router_logits: torch.Tensor, top_k: int, renormalize: bool, *, pdl: int = 0
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """router_logits `[N, E]` -> (weights fp32 `[N, k]`, ids int64 `[N, k]`, sorted_pairs int32 `[N * k]`, counts
    int32 `[E]`): `route_topk` then `group_by_expert(ids, E, 0)`, in one launch where `fused_route_group_applies`,
    else in those two."""
    n, e = router_logits.shape
    if not fused_route_group_applies(n, e, top_k) or not 1 <= top_k <= e:
        weights, ids = route_topk(router_logits, top_k, renormalize, pdl=pdl)
        return (weights, ids) + group_by_expert(ids, e, 0, pdl=pdl)
    if router_logits.stride(1) != 1:
        router_logits = router_logits.contiguous()
    dev = router_logits.device
    weights = torch.empty((n, top_k), dtype=torch.float32, device=dev)
    ids = torch.empty((n, top_k), dtype=torch.int64, device=dev)
    sorted_pairs = torch.empty(n * top_k, dtype=torch.int32, device=dev)
    counts = torch.empty(e, dtype=torch.int32, device=dev)
    e_pad = triton.next_power_of_2(e)
    rows = rows_per_program(n, e_pad)
    _route_group_kernel[(1,)](router_logits, weights, ids, sorted_pairs, counts, n, e, router_logits.stride(0),
                              K=top_k, R=rows, E_PAD=e_pad, K_PAD=triton.next_power_of_2(top_k),
                              RENORM=bool(renormalize), BLOCK_E=_block_e(e), num_warps=route_warps(rows, e_pad),
                              **PDL_LAUNCH[pdl])
    return weights, ids, sorted_pairs, counts


def route_and_run_experts(x: torch.Tensor, router_logits: torch.Tensor, top_k: int, renormalize: bool,
                          w13: torch.Tensor, w2: torch.Tensor, *, pdl: int = 0) -> torch.Tensor:
    """sum_j weights[n, j] * expert_{ids[n, j]}(x[n]) with (weights, ids) the router's top-k of router_logits:
    `triton_moe.routed_experts(x, *route_topk(...)[::-1]...)` with every expert local, the routing and grouping in
    one launch at small steps. Four launches there, five beyond."""
    n = x.shape[0]
    e, h, _ = _check_weights(x, w13, w2)
    if router_logits.shape != (n, e):
        raise ValueError(f"router_logits {tuple(router_logits.shape)} must be [{n}, {e}] for x {tuple(x.shape)}")
    if n == 0:
        return torch.empty((0, h), dtype=x.dtype, device=x.device)
    weights, ids, sorted_pairs, counts = route_and_group(router_logits, top_k, renormalize, pdl=pdl)
    return grouped_experts(x, ids, weights, sorted_pairs, counts, w13, w2, 0, pdl=pdl)
