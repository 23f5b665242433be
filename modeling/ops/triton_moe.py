"""Routed-expert MoE kernels: each token pair runs only the expert it is routed to; capturable at any size.

Two layouts call one grouped SwiGLU GEMM pair (`grouped_swiglu`):
- routed (`routed_experts`): x `[N, H]` with top-k ids `[N, k]` (global expert ids, -1 = none) and fp32 weights
  `[N, k]`; this rank holds experts `first_expert .. first_expert + E_local` (all-gather EP: pairs routed to other
  ranks' experts contribute zero). A counting sort on the device groups the N * k (token, slot) pairs by expert.
- packed (`packed_experts`): DeepEP's low-latency layout, x `[E_local, cap, H]` with `counts [E_local]`: the rows
  of expert e are `x[e, :counts[e]]` (the grouping is given; the combine lies with the dispatcher).

Kernels (all on the current stream; grids depend on shapes only, nothing is read on the host):
1. `_hist_kernel` (grid: chunks of BLOCK_P pairs; skipped when one chunk holds every pair): per-chunk expert
   counts `[chunks, BLOCK_E]`.
2. `_scatter_kernel` (same grid): counts, expert offsets (exclusive scan) and each valid pair's stable sorted
   position; writes `sorted_pairs[pos] = pair` and the per-expert counts. Same order as a stable argsort by
   expert, so results do not depend on the launch.
3. `_gemm13_kernel` (grid: row tiles x I tiles): each program maps its tile index to (expert, rows) from the
   counts alone (tiles of expert e follow those of experts < e; programs past the last tile exit), gathers its
   rows of x, multiplies by the gate and up rows of w13[e] and writes silu(gate) * up `[rows, I]`.
4. `_gemm2_kernel` (grid: row tiles x H tiles): the same tiles times w2[e]; routed layout: writes each row to its
   pair's slot `[N * k, H]`; packed: in place of the row.
5. `_combine_kernel` (routed only; grid: N x H tiles): out[n] = sum_j w[n, j] * y[n * k + j] in fp32 over the
   local pairs, in slot order (deterministic, no atomics).
The row-tile grid is the worst case over every routing, min(P, cdiv(P, BLOCK_M) + E_local) for P rows, so one
launch shape (and one captured graph) serves every expert load. Weights are read only for experts with rows.
Every launch takes the PDL mode `pdl` (`modeling.ops.pdl`; `KernelOps` binds `KernelOptions.moe_pdl`): each
kernel triggers its dependents first and waits before its first load, since all it reads (ids, counts, rows, and
through them which expert weights) comes from the step's earlier kernels; so only the launch and ramp-up of each
kernel overlap the one before it.

Numerics follow `modeling.ops.moe_ref` (fp32 accumulation; gate and up rounded to the activation dtype, silu
rounded, times up rounded, the down projection rounded, the weighted sum in fp32 rounded once). bf16, fp16 and
fp32 (fp32 dots in IEEE precision).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from modeling.ops.pdl import PDL_LAUNCH, pdl_launch_dependents, pdl_wait

_BLOCK_P = 128  # pairs per grouping program
_SCAN_C = 32  # chunk rows per step of the grouping scan


class MoeKernelError(ValueError):
    """Inputs the routed-expert kernels cannot take (shapes, dtypes, devices)."""


@dataclass(frozen=True)
class MoeGemmConfig:
    """Launch parameters of one grouped GEMM (`_gemm13_kernel`: BLOCK_N gate columns and as many up columns)."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def gemm_config(rows: int, e_local: int, gated: bool, dtype: torch.dtype) -> MoeGemmConfig:
    """Heuristic by the mean rows per expert (rows = worst-case pairs): 16-row tiles where decode streams weights,
    larger tiles as prefill reuses them. The prefill tiers are `python -m bench.moe_tune`'s winners for
    Qwen3-30B-A3B's experts: at 512 and 2048 tokens on an H200 (docs/benchmarks.md, seventeenth session), and the
    down GEMM's 256-column tiles above 64 rows per expert at 2048 and 4096 tokens on an H100 (twenty-ninth)."""
    if dtype == torch.float32:
        return MoeGemmConfig(16 if rows <= 16 * e_local else 32, 32, 32, 4, 2)
    mean = rows / max(1, e_local)
    if mean <= 16:
        return MoeGemmConfig(16, 32 if gated else 64, 128, 4, 4)
    if mean <= 64:
        return MoeGemmConfig(64, 64 if gated else 128, 64, 4, 3)
    return MoeGemmConfig(128, 128, 64, 8, 4) if gated else MoeGemmConfig(128, 256, 64, 8, 4)


def max_tiles(rows: int, e_local: int, block_m: int) -> int:
    """Row tiles any grouping of `rows` rows over `e_local` experts can need (each tile holds >= 1 row)."""
    return max(1, min(rows, triton.cdiv(rows, block_m) + e_local))


# ------------------------------------------------------------------------------------------------ grouping


@triton.jit
def _local_ids(IDS, offs_p, P, first_expert, e_local):
    ids = tl.load(IDS + offs_p, mask=offs_p < P, other=-1)
    local = (ids - first_expert).to(tl.int32)
    valid = (offs_p < P) & (ids >= 0) & (local >= 0) & (local < e_local)
    return tl.where(valid, local, -1), valid


@triton.jit
def _hist_kernel(IDS, CHUNK_CNT, P, first_expert, e_local, BLOCK_P: tl.constexpr, BLOCK_E: tl.constexpr,
                 PDL: tl.constexpr):
    pdl_launch_dependents(PDL)
    pdl_wait(PDL)
    c = tl.program_id(0)
    offs_p = c * BLOCK_P + tl.arange(0, BLOCK_P)
    local, _ = _local_ids(IDS, offs_p, P, first_expert, e_local)
    offs_e = tl.arange(0, BLOCK_E)
    onehot = (local[:, None] == offs_e[None, :]).to(tl.int32)
    tl.store(CHUNK_CNT + c * BLOCK_E + offs_e, tl.sum(onehot, axis=0))


@triton.jit
def _scatter_kernel(IDS, CHUNK_CNT, SORTED, COUNTS, P, num_chunks, first_expert, e_local,
                    BLOCK_P: tl.constexpr, BLOCK_E: tl.constexpr, SCAN_C: tl.constexpr, ONE_CHUNK: tl.constexpr,
                    PDL: tl.constexpr):
    pdl_launch_dependents(PDL)
    pdl_wait(PDL)
    c = tl.program_id(0)
    offs_e = tl.arange(0, BLOCK_E)
    offs_p = c * BLOCK_P + tl.arange(0, BLOCK_P)
    local, valid = _local_ids(IDS, offs_p, P, first_expert, e_local)
    onehot = (local[:, None] == offs_e[None, :]).to(tl.int32)
    if ONE_CHUNK:  # the whole grouping in one program: no histogram pass
        total = tl.sum(onehot, axis=0)
        before = tl.zeros([BLOCK_E], dtype=tl.int32)
    else:
        total = tl.zeros([BLOCK_E], dtype=tl.int32)
        before = tl.zeros([BLOCK_E], dtype=tl.int32)
        for c0 in range(0, num_chunks, SCAN_C):
            offs_c = c0 + tl.arange(0, SCAN_C)
            tab = tl.load(CHUNK_CNT + offs_c[:, None] * BLOCK_E + offs_e[None, :],
                          mask=offs_c[:, None] < num_chunks, other=0)
            total += tl.sum(tab, axis=0)
            before += tl.sum(tl.where(offs_c[:, None] < c, tab, 0), axis=0)
    if c == 0:
        tl.store(COUNTS + offs_e, total, mask=offs_e < e_local)
    start = tl.cumsum(total, axis=0) - total + before  # first sorted slot of this chunk's pairs, per expert
    rank = tl.cumsum(onehot, axis=0) - onehot  # earlier pairs of the same expert inside this chunk
    pos = tl.sum(tl.where(onehot != 0, start[None, :] + rank, 0), axis=1)
    tl.store(SORTED + pos, offs_p, mask=valid)


# ------------------------------------------------------------------------------------------------ grouped GEMMs


@triton.jit
def _tile(COUNTS, tile, e_local, pack_stride, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, PACKED: tl.constexpr):
    """(expert, first row, end row) of row tile `tile`; expert >= e_local when the tile has no rows."""
    offs_e = tl.arange(0, BLOCK_E)
    cnt = tl.load(COUNTS + offs_e, mask=offs_e < e_local, other=0)
    if PACKED:
        cnt = tl.minimum(cnt, pack_stride)
    tiles = (cnt + BLOCK_M - 1) // BLOCK_M
    cum = tl.cumsum(tiles, axis=0)
    expert = tl.sum((cum <= tile).to(tl.int32), axis=0)
    mine = offs_e == expert
    count = tl.sum(tl.where(mine, cnt, 0), axis=0)
    first_tile = tl.sum(tl.where(mine, cum - tiles, 0), axis=0)
    if PACKED:
        base = expert * pack_stride
    else:
        base = tl.sum(tl.where(offs_e < expert, cnt, 0), axis=0)
    return expert, base + (tile - first_tile) * BLOCK_M, base + count


@triton.jit
def swiglu_tile(x_ptrs, m_mask, g_ptrs, u_ptrs, n_mask, offs_k, K, dt, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    """silu(x @ gate^T) * (x @ up^T) of one tile: x rows `[BLOCK_M, BLOCK_K]` at x_ptrs (rows past m_mask read 0),
    gate / up rows `[BLOCK_N, BLOCK_K]` at g_ptrs / u_ptrs, K in BLOCK_K steps; fp32 accumulation, gate and up
    rounded to dt, silu rounded, the product rounded to dt (`moe_ref`'s rounding points). Shared by the grouped
    and the pair-by-pair gate/up kernels, so both give the same bits."""
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = offs_k + k0 < K
        x = tl.load(x_ptrs + k0, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w_mask = n_mask[:, None] & k_mask[None, :]
        acc_g = tl.dot(x, tl.trans(tl.load(g_ptrs + k0, mask=w_mask, other=0.0)), acc_g, input_precision=PRECISION)
        acc_u = tl.dot(x, tl.trans(tl.load(u_ptrs + k0, mask=w_mask, other=0.0)), acc_u, input_precision=PRECISION)
    g = acc_g.to(dt).to(tl.float32)
    u = acc_u.to(dt).to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
    return (act * u).to(dt)


@triton.jit
def _gemm13_kernel(X, SORTED, COUNTS, W13, ACT, e_local, pack_stride, I, K, stride_xm, stride_we, stride_wn,
                   stride_am, TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr, PACKED: tl.constexpr, PRECISION: tl.constexpr,
                   PDL: tl.constexpr):
    pdl_launch_dependents(PDL)
    pdl_wait(PDL)  # the counts, rows and expert ids all come from this step's kernels: nothing loads before it
    expert, row0, row_end = _tile(COUNTS, tl.program_id(0), e_local, pack_stride, BLOCK_M, BLOCK_E, PACKED)
    if expert >= e_local:
        return
    offs_m = row0 + tl.arange(0, BLOCK_M)
    m_mask = offs_m < row_end
    if PACKED:
        x_rows = offs_m
    else:
        x_rows = tl.load(SORTED + offs_m, mask=m_mask, other=0) // TOP_K
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < I
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = X + x_rows.to(tl.int64)[:, None] * stride_xm + offs_k[None, :]
    g_ptrs = W13 + expert.to(tl.int64) * stride_we + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
    out = swiglu_tile(x_ptrs, m_mask, g_ptrs, g_ptrs + I * stride_wn, n_mask, offs_k, K, ACT.dtype.element_ty,
                      BLOCK_M, BLOCK_N, BLOCK_K, PRECISION)
    tl.store(ACT + offs_m.to(tl.int64)[:, None] * stride_am + offs_n[None, :], out,
             mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _gemm2_kernel(ACT, SORTED, COUNTS, W2, Y, e_local, pack_stride, N, K, stride_am, stride_we, stride_wn, stride_ym,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr,
                  PACKED: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr):
    pdl_launch_dependents(PDL)
    pdl_wait(PDL)
    expert, row0, row_end = _tile(COUNTS, tl.program_id(0), e_local, pack_stride, BLOCK_M, BLOCK_E, PACKED)
    if expert >= e_local:
        return
    offs_m = row0 + tl.arange(0, BLOCK_M)
    m_mask = offs_m < row_end
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = ACT + offs_m.to(tl.int64)[:, None] * stride_am + offs_k[None, :]
    w_ptrs = W2 + expert.to(tl.int64) * stride_we + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = offs_k + k0 < K
        a = tl.load(a_ptrs + k0, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptrs + k0, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        acc = tl.dot(a, tl.trans(w), acc, input_precision=PRECISION)
    if PACKED:
        out_rows = offs_m
    else:
        out_rows = tl.load(SORTED + offs_m, mask=m_mask, other=0)
    tl.store(Y + out_rows.to(tl.int64)[:, None] * stride_ym + offs_n[None, :], acc.to(Y.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _combine_kernel(Y, IDS, W, OUT, first_expert, e_local, H, TOP_K: tl.constexpr, BLOCK_H: tl.constexpr,
                    PDL: tl.constexpr):
    pdl_launch_dependents(PDL)
    pdl_wait(PDL)
    n = tl.program_id(0)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = offs_h < H
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        e = tl.load(IDS + n * TOP_K + j)
        local = e - first_expert
        valid = (e >= 0) & (local >= 0) & (local < e_local)
        w = tl.load(W + n * TOP_K + j)
        y_mask = h_mask & (tl.zeros([BLOCK_H], dtype=tl.int32) + valid.to(tl.int32) > 0)
        y = tl.load(Y + (n * TOP_K + j).to(tl.int64) * H + offs_h, mask=y_mask, other=0.0)
        acc += tl.where(valid, w, 0.0) * y.to(tl.float32)
    tl.store(OUT + n.to(tl.int64) * H + offs_h, acc.to(OUT.dtype.element_ty), mask=h_mask)


# ------------------------------------------------------------------------------------------------ launchers


def check_weights(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> tuple[int, int, int]:
    """(E_local, H, I) of w13 `[E, 2I, H]` / w2 `[E, H, I]`, checked against x's last dim, dtype and device."""
    if w13.dim() != 3 or w2.dim() != 3 or w13.shape[1] % 2:
        raise MoeKernelError(f"w13 {tuple(w13.shape)} must be [E, 2I, H] and w2 {tuple(w2.shape)} [E, H, I]")
    e, i2, h = w13.shape
    if tuple(w2.shape) != (e, h, i2 // 2) or x.shape[-1] != h:
        raise MoeKernelError(f"x {tuple(x.shape)}, w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)}: shapes disagree")
    if not x.dtype == w13.dtype == w2.dtype or x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise MoeKernelError(f"dtypes {x.dtype}, {w13.dtype}, {w2.dtype}: need one of bf16, fp16, fp32")
    if not x.device == w13.device == w2.device:
        raise MoeKernelError("x, w13 and w2 must be on one device")
    if w13.stride(2) != 1 or w2.stride(2) != 1 or x.stride(-1) != 1:
        raise MoeKernelError("x, w13 and w2 need a unit last stride")
    return e, h, i2 // 2


def check_routed(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> tuple[int, int]:
    """(N, k) of the routed layout: x `[N, H]`, ids int64 `[N, k]`, weights fp32 `[N, k]`."""
    if x.dim() != 2 or ids.shape != weights.shape or ids.dim() != 2 or ids.shape[0] != x.shape[0]:
        raise MoeKernelError(f"x {tuple(x.shape)}, ids {tuple(ids.shape)}, weights {tuple(weights.shape)}")
    if ids.dtype != torch.int64 or weights.dtype != torch.float32:
        raise MoeKernelError(f"ids must be int64 and weights fp32, got {ids.dtype} / {weights.dtype}")
    return ids.shape


def _block_e(e_local: int) -> int:
    return max(16, triton.next_power_of_2(e_local))


def group_by_expert(ids: torch.Tensor, e_local: int, first_expert: int,
                    block_p: int | None = None, *, pdl: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """ids int64 `[N, k]` (global expert ids, -1 = none) -> (sorted_pairs int32 `[N * k]`, counts int32
    `[e_local]`): the flat pair indices (n * k + j) routed to local experts, grouped by expert in pair order
    (entries past sum(counts) are unspecified), and the pairs per local expert. One launch up to `block_p` pairs
    (default up to 128: every decode bucket up to 16 tokens at top-8), else two; no host read."""
    ids = ids.contiguous()
    p = ids.numel()
    block_e = _block_e(e_local)
    block_p = block_p or max(16, min(_BLOCK_P, triton.next_power_of_2(max(p, 1))))
    chunks = triton.cdiv(max(p, 1), block_p)
    sorted_pairs = torch.empty(max(p, 1), dtype=torch.int32, device=ids.device)
    counts = torch.empty(e_local, dtype=torch.int32, device=ids.device)
    chunk_cnt = counts
    warps = 8 if block_e * block_p >= 128 * 128 else 4
    if chunks > 1:
        chunk_cnt = torch.empty((chunks, block_e), dtype=torch.int32, device=ids.device)
        _hist_kernel[(chunks,)](ids, chunk_cnt, p, first_expert, e_local, BLOCK_P=block_p, BLOCK_E=block_e,
                                num_warps=warps, **PDL_LAUNCH[pdl])
    _scatter_kernel[(chunks,)](ids, chunk_cnt, sorted_pairs, counts, p, chunks, first_expert, e_local,
                               BLOCK_P=block_p, BLOCK_E=block_e, SCAN_C=_SCAN_C, ONE_CHUNK=chunks == 1,
                               num_warps=warps, **PDL_LAUNCH[pdl])
    return sorted_pairs[:p], counts


def grouped_swiglu(x: torch.Tensor, sorted_rows: torch.Tensor | None, counts: torch.Tensor, w13: torch.Tensor,
                   w2: torch.Tensor, rows: int, *, top_k: int = 1, pack_stride: int = 0,
                   configs: tuple[MoeGemmConfig, MoeGemmConfig] | None = None, pdl: int = 0) -> torch.Tensor:
    """w2[e] @ (silu(w13[e, :I] @ x_r) * (w13[e, I:] @ x_r)) for every grouped row r of every local expert e.

    Routed (sorted_rows = `group_by_expert`'s pairs): row r is pair sorted_rows[r] of x `[N, H]` (token
    pair // top_k); returns `[rows, H]` (rows = N * top_k) indexed by pair, rows of non-local pairs unspecified.
    Packed (sorted_rows None): x `[E * pack_stride, H]`, the rows of expert e start at e * pack_stride; returns
    the same shape, rows at or past counts[e] unspecified. counts int32 `[E_local]` on x's device. configs: the
    (w13, w2) GEMM launch configs, default `gemm_config` (benchmarks sweep them)."""
    e_local, h, inter = check_weights(x, w13, w2)
    dt = x.dtype
    prec = "ieee" if dt == torch.float32 else "tf32"
    packed = sorted_rows is None
    block_e = _block_e(e_local)
    act = torch.empty((rows, inter), dtype=dt, device=x.device)
    y = torch.empty((rows, h), dtype=dt, device=x.device)
    if rows == 0:
        return y
    srt = counts if packed else sorted_rows
    c1, c2 = configs or (gemm_config(rows, e_local, True, dt), gemm_config(rows, e_local, False, dt))
    _gemm13_kernel[(max_tiles(rows, e_local, c1.block_m), triton.cdiv(inter, c1.block_n))](
        x, srt, counts, w13, act, e_local, pack_stride, inter, h, x.stride(0), w13.stride(0), w13.stride(1),
        act.stride(0), TOP_K=top_k, BLOCK_M=c1.block_m, BLOCK_N=c1.block_n, BLOCK_K=c1.block_k, BLOCK_E=block_e,
        PACKED=packed, PRECISION=prec, num_warps=c1.num_warps, num_stages=c1.num_stages, **PDL_LAUNCH[pdl])
    _gemm2_kernel[(max_tiles(rows, e_local, c2.block_m), triton.cdiv(h, c2.block_n))](
        act, srt, counts, w2, y, e_local, pack_stride, h, inter, act.stride(0), w2.stride(0), w2.stride(1),
        y.stride(0), BLOCK_M=c2.block_m, BLOCK_N=c2.block_n, BLOCK_K=c2.block_k, BLOCK_E=block_e, PACKED=packed,
        PRECISION=prec, num_warps=c2.num_warps, num_stages=c2.num_stages, **PDL_LAUNCH[pdl])
    return y


def routed_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                   first_expert: int = 0, *, configs: tuple[MoeGemmConfig, MoeGemmConfig] | None = None,
                   pdl: int = 0) -> torch.Tensor:
    """sum_j weights[n, j] * expert_{ids[n, j]}(x[n]) over the local experts: x `[N, H]`, ids int64 `[N, k]`
    (global ids, -1 = none), weights fp32 `[N, k]`, w13 `[E_local, 2I, H]`, w2 `[E_local, H, I]` in x's dtype;
    returns `[N, H]` in x's dtype (0 for a token with no local expert). Five launches, capturable."""
    n, k = check_routed(x, ids, weights)
    e_local, h, _ = check_weights(x, w13, w2)
    out = torch.empty((n, h), dtype=x.dtype, device=x.device)
    if n == 0:
        return out
    ids, weights = ids.contiguous(), weights.contiguous()
    sorted_pairs, counts = group_by_expert(ids, e_local, first_expert, pdl=pdl)
    y = grouped_swiglu(x, sorted_pairs, counts, w13, w2, n * k, top_k=k, configs=configs, pdl=pdl)
    block_h = min(1024, triton.next_power_of_2(h))
    _combine_kernel[(n, triton.cdiv(h, block_h))](y, ids, weights, out, first_expert, e_local, h, TOP_K=k,
                                                  BLOCK_H=block_h, num_warps=4, **PDL_LAUNCH[pdl])
    return out


def packed_experts(x: torch.Tensor, counts: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, *,
                   pdl: int = 0) -> torch.Tensor:
    """DeepEP low-latency layout: x `[E_local, cap, H]`, counts int `[E_local]` (rows of expert e: x[e, :counts[e]])
    -> `[E_local, cap, H]`, expert e's output in its rows (rows at or past counts[e] unspecified). Two launches."""
    if x.dim() != 3 or counts.shape != (x.shape[0],) or x.shape[0] != w13.shape[0]:
        raise MoeKernelError(f"packed x {tuple(x.shape)} / counts {tuple(counts.shape)} / w13 {tuple(w13.shape)}")
    e, cap, h = x.shape
    if x.stride(2) != 1 or x.stride(0) != cap * x.stride(1):
        x = x.contiguous()
    y = grouped_swiglu(x.view(e * cap, h), None, counts.to(torch.int32), w13, w2, e * cap, pack_stride=cap, pdl=pdl)
    return y.view(e, cap, h)
