"""Decode GEMV with the RMSNorm before it and the SiLU-gate after it: y = act(norm(x) @ w^T) for 1 or 2 rows.

At batch 1 a decode step's projections are weight-streaming problems of 4-13 MB, and a kernel
boundary inside the CUDA graph costs about as much as streaming the weights. This kernel cuts
both: no tensor cores (rows are broadcast against the weight tile and reduced over K in fp32), no
split-K (every program owns BLOCK_N output columns and reads its weight rows once), and the
operators around the GEMM ride along:

- prologue `norm` (the layer's input RMSNorm, optionally with the residual add before it): every
  program recomputes the norm of its x rows (K values per row, from L2) and program 0 stores the
  new residual stream `x + residual`. No counter, no second pass over y, nothing to reset.
- epilogue `gated` (the MLP's SiLU-gate): weight rows [0, N) are the gate and [N, 2N) the up
  projection; a program owns both halves of its columns and writes silu(gate) * up `[M, N]`.

Numerics: rounded at the points of the unfused operators (`triton_fused.add_rms_norm`,
`rms_norm`, `silu_and_mul`): the sum `x + residual` and the normed rows are rounded to the
activation dtype before the GEMV, gate and up are rounded to it before the SiLU. The fp32 sums
(sum of squares, dot products) are ordered differently from those kernels and from cuBLAS.

The kernel takes up to GEMV_ROW_LIMIT = 4 rows (M_PAD 1, 2, 4: rows broadcast against the weight tile); `applies`
admits up to its `max_rows` argument, `KernelOptions.gemv_max_rows()`: by default 4 rows for models up to hidden
1024 and 2 up to 2048 (`options.GEMV_AUTO_ROWS`, where it measured faster than the kernels it replaces; set with
`GRAPHLINE_GEMV_ROWS`); 0 with `GRAPHLINE_GEMV=0`, which also turns off the model's norm-first layout. `linear`
and `norm_linear` of `triton_gemm` take it as their `gemv` argument.

Grid `(cdiv(N, BLOCK_N),)`, static, no host sync, no process-wide state: capturable anywhere.
Launch configs come from `_CONFIGS` (measured, `python -m bench.gemv_tune`), keyed by (N, K,
M_PAD, norm, gated); other shapes use `default_config`. Lifetime: outputs are new tensors from the caching
allocator on the current stream (graph-pool memory under capture).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from modeling.ops.pdl import PDL_LAUNCH, interpreted, pdl_launch_dependents, pdl_wait

GEMV_ROW_LIMIT = 4  # rows one program holds (M_PAD 1, 2, 4)
GEMV_DEFAULT_ROWS = 2  # rows up to which `applies` and the `triton_gemm` operators take the GEMV unless told
GEMV_MAX_N = 32768  # wider weights (the LM head) stay on the skinny GEMM, which streams them near roofline
NORM_NONE, NORM_RMS, NORM_ADD_RMS = 0, 1, 2


@dataclass(frozen=True)
class GemvConfig:
    """Launch parameters of one `_gemv_kernel` specialisation (M, N, K stay runtime values)."""

    block_n: int
    block_k: int
    num_warps: int
    num_stages: int = 1
    row_loop: bool = False  # whole-row programs (block_k >= K): one 2-D weight tile, the rows taken one by one
    # (faster at 1 row, not at 2 or 4: docs/benchmarks.md, twenty-fourth session)


@triton.jit
def _x_chunk(X, R, RS, offs_m, m_mask, offs_k, k_mask, stride_xm, stride_rm, store_rows, NORM: tl.constexpr):
    """fp32 `[M_PAD, BLOCK_K]` chunk of the GEMV's input rows before the norm's scale: x, or (x + residual) rounded
    to x's dtype (its rows below `store_rows` stored to RS)."""
    mask = m_mask[:, None] & k_mask[None, :]
    x = tl.load(X + offs_m[:, None] * stride_xm + offs_k[None, :], mask=mask, other=0.0)
    if NORM == 2:
        r = tl.load(R + offs_m[:, None] * stride_rm + offs_k[None, :], mask=mask, other=0.0)
        s = (x.to(tl.float32) + r.to(tl.float32)).to(X.dtype.element_ty)
        store = (offs_m < store_rows)[:, None] & k_mask[None, :]
        tl.store(RS + offs_m[:, None] * stride_rm + offs_k[None, :], s, mask=store)
        return s.to(tl.float32)
    return x.to(tl.float32)


@triton.jit
def _norm_scale(x, rstd, NW, offs_k, k_mask, DT: tl.constexpr):
    """fp32 rows x `[M_PAD, BLOCK_K]` times rstd `[M_PAD]`, rounded, times the norm weight, rounded (`rms_norm`)."""
    nw = tl.load(NW + offs_k, mask=k_mask, other=0.0).to(tl.float32)
    n = (x * rstd[:, None]).to(DT).to(tl.float32)
    return (n * nw[None, :]).to(DT).to(tl.float32)


@triton.jit
def _store_normed(NO, x, offs_m, offs_k, k_mask, store_rows, K, KEEP_NORMED: tl.constexpr):
    """With KEEP_NORMED, the normed rows x (fp32 `[M_PAD, BLOCK_K]`, already rounded to NO's dtype) below
    store_rows to NO `[M, K]` (contiguous)."""
    if KEEP_NORMED:
        mask = (offs_m < store_rows)[:, None] & k_mask[None, :]
        tl.store(NO + offs_m[:, None] * K + offs_k[None, :], x.to(NO.dtype.element_ty), mask=mask)


@triton.jit
def _row_gemv(X, R, RS, NW, NO, Y, w, u, mi, M, K, offs_k, k_mask, offs_n, n_mask, stride_xm, stride_rm, stride_ym,
              eps, store_rows, NORM: tl.constexpr, GATED: tl.constexpr, KEEP_NORMED: tl.constexpr):
    """Row `mi` of the whole-row GEMV against the fp32 weight tile(s) w (u: the up half) `[BLOCK_N, BLOCK_K]`: the
    prologue and epilogue of `_gemv_kernel`, one row at a time (rows >= M load and store nothing; rows below
    store_rows store the new residual stream, and with KEEP_NORMED the normed row to NO)."""
    DT = X.dtype.element_ty
    row_k = offs_k * 0 + mi
    lm = k_mask & (row_k < M)
    x = tl.load(X + mi * stride_xm + offs_k, mask=lm, other=0.0).to(tl.float32)
    if NORM == 2:
        s = (x + tl.load(R + mi * stride_rm + offs_k, mask=lm, other=0.0).to(tl.float32)).to(DT)
        tl.store(RS + mi * stride_rm + offs_k, s, mask=lm & (row_k < store_rows))
        x = s.to(tl.float32)
    if NORM != 0:
        rstd = tl.rsqrt(tl.sum(x * x, axis=0) / K + eps)
        nw = tl.load(NW + offs_k, mask=k_mask, other=0.0).to(tl.float32)
        x = ((x * rstd).to(DT).to(tl.float32) * nw).to(DT).to(tl.float32)
        if KEEP_NORMED:
            tl.store(NO + mi * K + offs_k, x.to(NO.dtype.element_ty), mask=lm & (row_k < store_rows))
    acc = tl.sum(x[None, :] * w, axis=1)
    y_mask = n_mask & (offs_n * 0 + mi < M)
    if GATED:
        g = acc.to(Y.dtype.element_ty).to(tl.float32)
        up = tl.sum(x[None, :] * u, axis=1).to(Y.dtype.element_ty).to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(Y.dtype.element_ty).to(tl.float32)
        tl.store(Y + mi * stride_ym + offs_n, (act * up).to(Y.dtype.element_ty), mask=y_mask)
    else:
        tl.store(Y + mi * stride_ym + offs_n, acc.to(Y.dtype.element_ty), mask=y_mask)


@triton.jit(do_not_specialize=["M"])
def _gemv_kernel(X, R, RS, NW, NO, W, Y, M, N, K, stride_xm, stride_rm, stride_wn, stride_ym, eps,
                 NORM: tl.constexpr, GATED: tl.constexpr, M_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, SINGLE: tl.constexpr, ROW_LOOP: tl.constexpr, KEEP_NORMED: tl.constexpr,
                 PDL: tl.constexpr):
    """Y `[M, N]` = act(norm(X) @ W^T); W `[N, K]` (`[2N, K]` when GATED); R / RS `[M, K]` residual in / sum out
    (row stride stride_rm), NW `[K]` the norm weight. NORM: 0 none, 1 rms_norm(X), 2 rms_norm(X + R); with
    KEEP_NORMED (NORM 1-2) program 0 also stores the normed rows to NO `[M, K]` (contiguous).
    SINGLE (BLOCK_K >= K): the program's whole weight tile is loaded first (before the PDL wait), then x; with
    ROW_LOOP the rows are multiplied one at a time against that 2-D tile (`_row_gemv`) instead of as one
    `[M_PAD, BLOCK_N, BLOCK_K]` broadcast."""
    pdl_launch_dependents(PDL)
    pid = tl.program_id(0)
    offs_m = tl.arange(0, M_PAD)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_kb = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    w_rows = W + offs_n.to(tl.int64)[:, None] * stride_wn
    u_rows = W + (offs_n + N).to(tl.int64)[:, None] * stride_wn
    store_rows = tl.where(pid == 0, M, 0)  # program 0 stores the new residual stream (and the normed rows)
    DT = X.dtype.element_ty
    if SINGLE and ROW_LOOP:
        k_mask = offs_kb < K
        w_mask = n_mask[:, None] & k_mask[None, :]
        wf = tl.load(w_rows + offs_kb[None, :], mask=w_mask, other=0.0).to(tl.float32)
        uf = wf
        if GATED:
            uf = tl.load(u_rows + offs_kb[None, :], mask=w_mask, other=0.0).to(tl.float32)
        pdl_wait(PDL)
        for mi in tl.static_range(M_PAD):
            _row_gemv(X, R, RS, NW, NO, Y, wf, uf, mi, M, K, offs_kb, k_mask, offs_n, n_mask, stride_xm, stride_rm,
                      stride_ym, eps, store_rows, NORM, GATED, KEEP_NORMED)
    else:
        if SINGLE:
            k_mask = offs_kb < K
            w_mask = n_mask[:, None] & k_mask[None, :]
            w = tl.load(w_rows + offs_kb[None, :], mask=w_mask, other=0.0)
            if GATED:
                u = tl.load(u_rows + offs_kb[None, :], mask=w_mask, other=0.0)
            pdl_wait(PDL)
            x = _x_chunk(X, R, RS, offs_m, m_mask, offs_kb, k_mask, stride_xm, stride_rm, store_rows, NORM)
            if NORM != 0:
                x = _norm_scale(x, tl.rsqrt(tl.sum(x * x, axis=1) / K + eps), NW, offs_kb, k_mask, DT)
                _store_normed(NO, x, offs_m, offs_kb, k_mask, store_rows, K, KEEP_NORMED)
            x3 = x[:, None, :]
            acc = tl.sum(x3 * w.to(tl.float32)[None, :, :], axis=2)
            if GATED:
                acc_u = tl.sum(x3 * u.to(tl.float32)[None, :, :], axis=2)
        else:
            pdl_wait(PDL)
            if NORM != 0:  # first pass: the rows' sums of squares
                ssq = tl.zeros([M_PAD], dtype=tl.float32)
                for k0 in range(0, K, BLOCK_K):
                    offs_k = k0 + offs_kb
                    s = _x_chunk(X, R, RS, offs_m, m_mask, offs_k, offs_k < K, stride_xm, stride_rm, 0, NORM)
                    ssq += tl.sum(s * s, axis=1)
                rstd = tl.rsqrt(ssq / K + eps)
            acc = tl.zeros([M_PAD, BLOCK_N], dtype=tl.float32)
            acc_u = tl.zeros([M_PAD, BLOCK_N], dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                offs_k = k0 + offs_kb
                k_mask = offs_k < K
                w_mask = n_mask[:, None] & k_mask[None, :]
                w = tl.load(w_rows + offs_k[None, :], mask=w_mask, other=0.0).to(tl.float32)
                if GATED:
                    u = tl.load(u_rows + offs_k[None, :], mask=w_mask, other=0.0).to(tl.float32)
                x = _x_chunk(X, R, RS, offs_m, m_mask, offs_k, k_mask, stride_xm, stride_rm, store_rows, NORM)
                if NORM != 0:
                    x = _norm_scale(x, rstd, NW, offs_k, k_mask, DT)
                    _store_normed(NO, x, offs_m, offs_k, k_mask, store_rows, K, KEEP_NORMED)
                x3 = x[:, None, :]
                acc += tl.sum(x3 * w[None, :, :], axis=2)
                if GATED:
                    acc_u += tl.sum(x3 * u[None, :, :], axis=2)
        y_mask = m_mask[:, None] & n_mask[None, :]
        y_ptrs = Y + offs_m[:, None] * stride_ym + offs_n[None, :]
        if GATED:
            g = acc.to(Y.dtype.element_ty).to(tl.float32)
            up = acc_u.to(Y.dtype.element_ty).to(tl.float32)
            act = (g / (1.0 + tl.exp(-g))).to(Y.dtype.element_ty).to(tl.float32)
            tl.store(y_ptrs, (act * up).to(Y.dtype.element_ty), mask=y_mask)
        else:
            tl.store(y_ptrs, acc.to(Y.dtype.element_ty), mask=y_mask)


def m_pad(m: int) -> int:
    """Rows a program holds for M rows: 1, 2 or 4."""
    return 1 if m == 1 else 2 if m == 2 else 4


# (N, K, M_PAD, norm, gated) -> (BLOCK_N, BLOCK_K, num_warps, num_stages[, row_loop]). N is the output width (the
# SiLU-gate's width when gated). Measured by `python -m bench.gemv_tune` on one H200 (per call inside a CUDA graph over weight
# copies; the figures against the unfused kernels are in docs/benchmarks.md): Qwen3-0.6B at TP=1 (tenth session,
# docs/results/gemv_tune_s10.log), and at 2 rows the TP=1 projections of Qwen3-1.7B, 8B, 14B and 30B-A3B (`--shapes`,
# seventeenth session, docs/results/gemv_tune_s17.log). Their 1-row winners are left out: inside the model they did
# not beat the heuristic (8B) or were slower (30B-A3B), see docs/benchmarks.md. The 1-row entries of Qwen3-0.6B and
# 1.7B are the row-at-a-time form's winners of the twenty-fourth session on an H100 (`--row-loop`,
# docs/results/gemv_tune_rowloop_s24_call3.log), which ran those models' batch-1 steps at 0.87x / 0.97x.
_CONFIGS: dict[tuple[int, int, int, int, bool], tuple] = {
    # Qwen3-0.6B
    (4096, 1024, 1, 2, False): (2, 1024, 4, 1, True),  # qkv M=1
    (4096, 1024, 2, 2, False): (16, 1024, 4, 1),  # qkv M=2
    (1024, 2048, 1, 0, False): (2, 2048, 8, 1, True),  # o_proj M=1
    (1024, 2048, 2, 0, False): (4, 2048, 4, 1),  # o_proj M=2
    (3072, 1024, 1, 2, True): (2, 1024, 4, 1, True),  # gate_up M=1
    (3072, 1024, 2, 2, True): (4, 1024, 4, 1),  # gate_up M=2
    (1024, 3072, 1, 0, False): (1, 4096, 8, 1, True),  # down M=1
    (1024, 3072, 2, 0, False): (4, 4096, 4, 1),  # down M=2
    # Qwen3-0.6B at 3-4 rows (M_PAD 4; the 4-row winners of the twenty-fourth session on an H100,
    # docs/results/gemv_tune_m34_s24_call1.log), which the model's 3-4 row A/B ran with
    (4096, 1024, 4, 2, False): (8, 1024, 4, 1),
    (1024, 2048, 4, 0, False): (4, 2048, 4, 1),
    (3072, 1024, 4, 2, True): (4, 1024, 4, 1),
    (1024, 3072, 4, 0, False): (2, 4096, 4, 1),
    # Qwen3-1.7B at 1 row (down: K chunks, where the row-at-a-time form does not apply)
    (4096, 2048, 1, 2, False): (2, 2048, 8, 1, True),
    (2048, 2048, 1, 0, False): (1, 2048, 4, 1, True),
    (6144, 2048, 1, 2, True): (1, 2048, 4, 1, True),
    (2048, 6144, 1, 0, False): (2, 2048, 8, 2),
    # Qwen3-1.7B at 2 rows: qkv, o_proj, gate_up, down (so for each preset below)
    (4096, 2048, 2, 2, False): (8, 2048, 4, 1),
    (2048, 2048, 2, 0, False): (4, 2048, 4, 1),
    (6144, 2048, 2, 2, True): (4, 2048, 4, 1),
    (2048, 6144, 2, 0, False): (4, 2048, 4, 1),
    # Qwen3-8B
    (6144, 4096, 2, 2, False): (4, 4096, 4, 1),
    (4096, 4096, 2, 0, False): (2, 4096, 4, 1),
    (12288, 4096, 2, 2, True): (2, 4096, 4, 1),
    (4096, 12288, 2, 0, False): (8, 2048, 8, 2),
    # Qwen3-14B (gate_up has more rows than GEMV_MAX_N: the skinny GEMM / cuBLAS choice serves it)
    (7168, 5120, 2, 2, False): (8, 1024, 4, 1),
    (5120, 5120, 2, 0, False): (8, 1024, 4, 2),
    (5120, 17408, 2, 0, False): (4, 2048, 4, 1),
    # Qwen3-30B-A3B attention (its experts take the routed-expert kernel)
    (5120, 2048, 2, 2, False): (4, 2048, 4, 1),
    (2048, 4096, 2, 0, False): (2, 4096, 4, 1),
}
_MAX_SINGLE_K = 8192  # up to here a program holds whole weight rows (one chunk); longer rows loop over 4096-chunks


@functools.lru_cache(maxsize=None)
def default_config(n: int, k: int, gated: bool) -> GemvConfig:
    """Heuristic for shapes and row counts not in `_CONFIGS`, after the Qwen3-0.6B sweep's winners: whole rows in
    one chunk, about 8K weight elements per program (4K per half when gated), 4 warps."""
    block_k = triton.next_power_of_2(k)
    if block_k > _MAX_SINGLE_K:
        block_k = 4096
    block_n = max(1, min(16, (4096 if gated else 8192) // block_k))
    return GemvConfig(block_n, block_k, 4)


def config_for(n: int, k: int, m: int, norm: int, gated: bool) -> GemvConfig:
    """The launch config for `m` rows of weight `[n, k]` (`[2n, k]` gated) with prologue `norm` (0, 1, 2)."""
    entry = _CONFIGS.get((n, k, m_pad(m), norm, gated))
    return GemvConfig(*entry) if entry is not None else default_config(n, k, gated)


def applies(x: torch.Tensor, weight: torch.Tensor, max_rows: int = GEMV_DEFAULT_ROWS) -> bool:
    """Whether the GEMV serves x `[M, K]` @ weight^T: x 2-D with M <= min(max_rows, GEMV_ROW_LIMIT) rows and unit
    last stride, weight 2-D with unit last stride and at most GEMV_MAX_N rows (larger ones, the LM head, stay on
    the skinny GEMM), both bf16 or both fp16 on one CUDA device (or any device under the Triton interpreter).
    `max_rows`: the caller's `gemv` option (`KernelOptions.gemv_max_rows()`, 0 = off)."""
    return (x.dim() == 2 and weight.dim() == 2 and 0 < x.shape[0] <= min(max_rows, GEMV_ROW_LIMIT)
            and x.shape[1] == weight.shape[1]
            and weight.shape[0] <= GEMV_MAX_N and x.dtype in (torch.bfloat16, torch.float16)
            and weight.dtype == x.dtype and x.stride(1) == 1 and weight.stride(1) == 1 and x.device == weight.device
            and (x.is_cuda or interpreted()))


def gemv_with_config(x: torch.Tensor, weight: torch.Tensor, cfg: GemvConfig, *, residual: torch.Tensor | None = None,
                     norm_weight: torch.Tensor | None = None, eps: float = 0.0, gated: bool = False,
                     out: torch.Tensor | None = None, normed_out: torch.Tensor | None = None,
                     pdl: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One `_gemv_kernel` launch. x `[M<=4, K]` (unit last stride), weight `[N, K]` (`[2N, K]` gated, unit last
    stride), residual `[M, K]` contiguous, norm_weight `[K]` contiguous, all one dtype on one CUDA device (CPU under
    the interpreter). norm_weight given: x is normed first (with residual: x + residual, whose rounded sum is
    returned as a new `[M, K]` tensor), and `normed_out` (contiguous `[M, K]` in x's dtype) receives the normed
    rows if given. Returns (y `[M, N]` in x's dtype, the sum or None); launched on the current
    stream with PDL mode `pdl` (`modeling.ops.pdl`); outputs are new tensors (graph-pool memory under capture)
    unless `out` is given."""
    m, k = x.shape
    n = weight.shape[0] // 2 if gated else weight.shape[0]
    norm = NORM_NONE if norm_weight is None else NORM_RMS if residual is None else NORM_ADD_RMS
    y = out if out is not None else torch.empty((m, n), dtype=x.dtype, device=x.device)
    summed = torch.empty((m, k), dtype=x.dtype, device=x.device) if norm == NORM_ADD_RMS else None
    r = residual if residual is not None else x
    if normed_out is not None and (norm == NORM_NONE or normed_out.shape != (m, k) or not normed_out.is_contiguous()):
        raise ValueError(f"normed_out {tuple(normed_out.shape)} needs a norm and a contiguous [{m}, {k}] tensor")
    _gemv_kernel[(triton.cdiv(n, cfg.block_n),)](
        x, r, summed if summed is not None else x, norm_weight if norm_weight is not None else x,
        normed_out if normed_out is not None else x, weight, y,
        m, n, k, x.stride(0), r.stride(0), weight.stride(0), y.stride(0), eps,
        NORM=norm, GATED=gated, M_PAD=m_pad(m), BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SINGLE=cfg.block_k >= k,
        ROW_LOOP=cfg.row_loop, KEEP_NORMED=normed_out is not None,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **PDL_LAUNCH[pdl])
    return y, summed


def gemv(x: torch.Tensor, weight: torch.Tensor, *, pdl: int = 0) -> torch.Tensor:
    """x `[M, K]` @ weight `[N, K]`^T -> `[M, N]` in x's dtype, one launch; requires `applies(x, weight)`."""
    cfg = config_for(weight.shape[0], x.shape[1], x.shape[0], NORM_NONE, False)
    return gemv_with_config(x, weight, cfg, pdl=pdl)[0]


def norm_gemv(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
              weight: torch.Tensor, gated: bool = False, *, pdl: int = 0,
              normed_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(linear(rms_norm(x + residual) * norm_weight, weight), x + residual) in one launch (residual None: the
    norm of x, and x itself as the stream). gated: weight is `[2N, K]` (gate then up rows) and the first output
    is silu(gate) * up `[M, N]`. Requires `applies(x, weight)`, residual `[M, K]` and norm_weight `[K]` in x's
    dtype. normed_out (contiguous `[M, K]` in x's dtype): also receives the normed rows (`KEEP_NORMED`)."""
    m, k = x.shape
    n = weight.shape[0] // 2 if gated else weight.shape[0]
    norm = NORM_RMS if residual is None else NORM_ADD_RMS
    cfg = config_for(n, k, m, norm, gated)
    y, summed = gemv_with_config(x, weight, cfg, residual=None if residual is None else residual.contiguous(),
                                 norm_weight=norm_weight.contiguous(), eps=eps, gated=gated,
                                 normed_out=normed_out, pdl=pdl)
    return y, (x if summed is None else summed)
