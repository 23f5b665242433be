"""Skinny GEMM for decode: y `[M, N]` = x `[M, K]` @ w `[N, K]`^T for small M (<= 64).

At batch 1..16 a decode step is a weight-streaming problem; cuBLAS picks small-tile
kernels that reach a fraction of HBM bandwidth there. This kernel gives each program
BLOCK_N output columns for all M rows and streams its weight rows in BLOCK_K chunks.
Grid `(cdiv(N, BLOCK_N), SPLIT_K)`: static, no host sync, capturable. Larger M falls
back to `F.linear`.

Split-K (SPLIT_K > 1) stays one launch and is deterministic: every program writes
its fp32 partial tile to a workspace `[SPLIT_K, M, N]`, then bumps a per-N-tile int32
arrival counter (acq_rel, gpu scope); the program that arrives last sums the partials
in the fixed order s = 0..SPLIT_K-1, writes y and resets its counter to 0.

Process-wide state (documented exception to the no-global-state rule): one
zero-initialised int32 counter tensor per device, `_COUNTER_SLOTS` entries, allocated
by the first call on that device. That first call must happen outside CUDA graph
capture (the warm-up before every capture guarantees it; a capture that would
allocate raises `GemmNotWarmedUpError`). All calls share the counters, so split-K
launches on one device must be stream-ordered (one forward stream per rank, as the
runner does); two split-K GEMMs running concurrently on different streams of one
device are unsupported. Every launch leaves the counters at zero.

Configs come from `_CONFIGS` (`triton_gemm_tables.CONFIGS`), keyed by (N, K, M class) with M class 1 (M == 1),
4 (M <= 4), 16 (M <= 16), 32 (M <= 32) or 64 (M <= 64), values (BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages);
the row tile BLOCK_M is the class's (`block_m`: 16 up to class 16, then 32 and 64);
shapes not in the table take the faster of cuBLAS and `default_config` as chosen at
warm-up (`projection_choice`, `triton_gemm_measure`), `default_config` before that.
`python -m bench.gemm_tune` prints a ready-to-paste table.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from modeling.ops import projection_choice, triton_gemv
from modeling.ops.pdl import PDL_LAUNCH, pdl_launch_dependents, pdl_wait
from modeling.ops.triton_fused import add_rms_norm, add_rms_norm_row, rms_norm, silu_and_mul
from modeling.ops.triton_gemm_tables import CONFIGS as _CONFIGS, GATED_CONFIGS as _GATED_CONFIGS

SKINNY_MAX_M = 64
_COUNTER_SLOTS = 1 << 16
_NORM_SLOT = _COUNTER_SLOTS - 1  # the fused add + RMSNorm's whole-row arrival counter; N-tiles use slots below
FUSED_NORM_MAX_M = 4  # the last program normalises the rows one by one: kept to small M (larger M not measured)
FUSED_NORM_MAX_N = 8192  # one row lives in the registers of one program
_SMEM_BUDGET = 100 * 1024  # bytes per CTA in the heuristic: two CTAs fit in an SM's 227 KiB


class GemmNotWarmedUpError(RuntimeError):
    """The split-K counters of a device would be allocated inside CUDA graph capture."""


@dataclass(frozen=True)
class GemmConfig:
    """Launch parameters of one `_skinny_gemm_kernel` specialisation (M, N, K stay runtime values)."""

    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int

    def smem_bytes(self, block_m: int = 16) -> int:
        """Upper bound of the shared memory per CTA at row tile `block_m` (triton 3.9 on sm_90 allocates
        max(1, num_stages - 1) stages)."""
        return self.num_stages * (block_m + self.block_n) * self.block_k * 2


def fuses_norm(m: int, n: int) -> bool:
    """Whether `linear_add_rms_norm`'s skinny-GEMM path fuses the residual add + RMSNorm into the GEMM's epilogue
    for m rows of n columns (else it runs `add_rms_norm` after the GEMM)."""
    return m <= FUSED_NORM_MAX_M and n <= FUSED_NORM_MAX_N


def block_m(m: int) -> int:
    """The row tile of M rows (or of a row class): its row class, at least 16 for tl.dot (rows >= M are masked)."""
    return max(16, projection_choice.m_class(m))


@triton.jit
def _add_rms_norm_rows(Y, CNT, R, RS, NW, NO, eps, M, N, stride_ym,
                       NORM_SLOT: tl.constexpr, BLOCK_H: tl.constexpr):
    """Called by each program that wrote a finished N-tile of Y: the last of them (second-level arrival
    counter CNT[NORM_SLOT]) computes RS = Y + R and NO = rms_norm(RS) * NW for all M rows with
    `triton_fused.add_rms_norm`'s row code (the fp32 sum of squares may be ordered differently: another layout)."""
    tl.debug_barrier()  # this program's Y stores precede its release below
    done = tl.atomic_add(CNT + NORM_SLOT, 1, sem="acq_rel", scope="gpu")
    if done == tl.num_programs(0) - 1:
        offs = tl.arange(0, BLOCK_H)
        mask = offs < N
        w = tl.load(NW + offs, mask=mask, other=0.0).to(tl.float32)
        for m in range(0, M):
            y = tl.load(Y + m * stride_ym + offs, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
            add_rms_norm_row(y, R + m * N, RS + m * N, NO + m * N, w, offs, mask, N, eps)
        tl.store(CNT + NORM_SLOT, 0)


@triton.jit
def _load_w_chunk(w_ptrs, offs_k, k0, K, m_mask, n_mask, EVEN_K: tl.constexpr):
    """The weight chunk `[BLOCK_N, BLOCK_K]` at `w_ptrs`, which point at K offset k0 of this program's slice
    (k0 only masks the tail), and the mask of its x chunk."""
    if EVEN_K:
        x_mask = m_mask[:, None]
        w = tl.load(w_ptrs, mask=n_mask[:, None], other=0.0)
    else:
        k_mask = offs_k + k0 < K
        x_mask = m_mask[:, None] & k_mask[None, :]
        w = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
    return w, x_mask


@triton.jit
def _load_x_chunk(x_ptrs, x_mask, K, GATED: tl.constexpr, DTYPE: tl.constexpr):
    """The x chunk `[BLOCK_M, BLOCK_K]` at x_ptrs; GATED: silu(gate) * up from X `[M, 2K]`, rounded exactly as
    `silu_and_mul` rounds them."""
    if GATED:
        g = tl.load(x_ptrs, mask=x_mask, other=0.0).to(tl.float32)
        u = tl.load(x_ptrs + K, mask=x_mask, other=0.0).to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(DTYPE).to(tl.float32)
        x = (act * u).to(DTYPE)
    else:
        x = tl.load(x_ptrs, mask=x_mask, other=0.0)
    return x


@triton.jit(do_not_specialize=["M"])
def _skinny_gemm_kernel(X, W, Y, WS, CNT, M, N, K, stride_xm, stride_wn, stride_ym, R, RS, NW, NO, eps,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr, GATED: tl.constexpr,
                        NORM: tl.constexpr, NORM_SLOT: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr):
    pdl_launch_dependents(PDL)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    # K slice of this program: whole BLOCK_K chunks; with EVEN_K it is exactly K // SPLIT_K.
    k_per_split = tl.cdiv(K, SPLIT_K * BLOCK_K) * BLOCK_K
    k_start = pid_k * k_per_split
    offs_k = k_start + tl.arange(0, BLOCK_K)
    x_ptrs = X + offs_m[:, None] * stride_xm + offs_k[None, :]
    w_ptrs = W + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if PDL != 0:
        # The first weight chunk streams in while the previous kernel finishes (`modeling.ops.pdl`, rule 2).
        w, x_mask = _load_w_chunk(w_ptrs, offs_k, 0, K, m_mask, n_mask, EVEN_K)
        pdl_wait(PDL)
        acc += tl.dot(_load_x_chunk(x_ptrs, x_mask, K, GATED, W.dtype.element_ty), tl.trans(w))
        for k0 in range(BLOCK_K, k_per_split, BLOCK_K):
            w, x_mask = _load_w_chunk(w_ptrs + k0, offs_k, k0, K, m_mask, n_mask, EVEN_K)
            acc += tl.dot(_load_x_chunk(x_ptrs + k0, x_mask, K, GATED, W.dtype.element_ty), tl.trans(w))
    else:  # one loop over every chunk, as before PDL: its software pipeline prefetches them all
        for k0 in range(0, k_per_split, BLOCK_K):
            w, x_mask = _load_w_chunk(w_ptrs, offs_k, k0, K, m_mask, n_mask, EVEN_K)
            acc += tl.dot(_load_x_chunk(x_ptrs, x_mask, K, GATED, W.dtype.element_ty), tl.trans(w))
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
    y_mask = m_mask[:, None] & n_mask[None, :]
    y_ptrs = Y + offs_m[:, None] * stride_ym + offs_n[None, :]
    if SPLIT_K == 1:
        tl.store(y_ptrs, acc.to(Y.dtype.element_ty), mask=y_mask)
        if NORM:
            _add_rms_norm_rows(Y, CNT, R, RS, NW, NO, eps, M, N, stride_ym, NORM_SLOT, BLOCK_H)
    else:
        ws_tile = offs_m[:, None] * N + offs_n[None, :]
        tl.store(WS + pid_k * M * N + ws_tile, acc, mask=y_mask)
        # All threads' partial stores precede the (single-thread) release of the counter increment.
        tl.debug_barrier()
        arrived = tl.atomic_add(CNT + pid_n, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            # Last arrival: its acquire saw every other program's release; .cg reads bypass L1.
            total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for s in tl.static_range(SPLIT_K):
                total += tl.load(WS + s * M * N + ws_tile, mask=y_mask, other=0.0, cache_modifier=".cg")
            tl.store(y_ptrs, total.to(Y.dtype.element_ty), mask=y_mask)
            tl.store(CNT + pid_n, 0)  # every program of this tile has arrived: nobody reads it again this launch
            if NORM:
                _add_rms_norm_rows(Y, CNT, R, RS, NW, NO, eps, M, N, stride_ym, NORM_SLOT, BLOCK_H)


_counters: dict[torch.device, torch.Tensor] = {}


def split_k_counters(device: torch.device) -> torch.Tensor:
    """The device's int32 `[_COUNTER_SLOTS]` arrival counters (zero between launches); allocated on first use.

    Lives for the process. Raises `GemmNotWarmedUpError` if the first use is inside CUDA graph capture.
    (A CPU device only occurs under TRITON_INTERPRET=1.)
    """
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    cnt = _counters.get(device)
    if cnt is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise GemmNotWarmedUpError("call modeling.ops.triton_gemm.linear once on this device before capture")
        cnt = torch.zeros(_COUNTER_SLOTS, dtype=torch.int32, device=device)
        _counters[device] = cnt
    return cnt


m_class = projection_choice.m_class  # config row class of M rows: 1, 4, 16, 32 or 64 (M <= the class)


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


@functools.lru_cache(maxsize=None)
def default_config(n: int, k: int, mc: int, sms: int = 132) -> GemmConfig:
    """Heuristic for shapes not in `_CONFIGS`: >= 2 CTAs per SM by split-K, <= ~100 KiB shared memory per CTA;
    row classes 32 and 64 take twice as wide N tiles and at most 128-deep K chunks (their row tile is 2-4x taller)."""
    block_n = (16 if n <= 16384 else 32) * (2 if mc >= 32 else 1)
    block_k = min(256 if mc < 32 else 128, max(16, triton.next_power_of_2(k)))
    tiles = triton.cdiv(n, block_n)
    split_k = 1
    while split_k < 8 and tiles * split_k < 2 * sms and k % (2 * split_k * block_k) == 0:
        split_k *= 2
    stage_bytes = (block_m(mc) + block_n) * block_k * 2
    stages = max(1, min(3, _SMEM_BUDGET // stage_bytes))
    return GemmConfig(block_n, block_k, split_k, 4, stages)


def config_for(n: int, k: int, m: int, device: torch.device | None = None, gated: bool = False) -> GemmConfig | None:
    """The launch config `linear` (gated: `silu_mul_linear`) uses for weight `[n, k]` and `m` rows; None = cuBLAS
    (gated: the unfused pair) is faster there. Ungated: `projection_choice.choose` (the table, else the fallback
    chosen on this device at warm-up, else `default_config`)."""
    mc = m_class(m)
    if gated and (n, k, mc) in _GATED_CONFIGS:
        entry = _GATED_CONFIGS[(n, k, mc)]
        return None if entry is None else GemmConfig(*entry)

    def index() -> int:
        return device.index if device is not None and device.index is not None else torch.cuda.current_device()

    def safe() -> tuple[int, int, int, int, int]:
        c = default_config(n, k, mc, _sm_count(index()))
        return (c.block_n, c.block_k, c.split_k, c.num_warps, c.num_stages)

    choice = projection_choice.choose(n, k, m, _CONFIGS, safe, index)
    return None if choice.kernel == "cublas" else GemmConfig(*choice.config)


def _launch(x: torch.Tensor, weight: torch.Tensor, cfg: GemmConfig, y: torch.Tensor, gated: bool,
            norm: tuple | None = None, pdl: int = 0) -> None:
    """One `_skinny_gemm_kernel` launch writing y `[M, N]` with PDL mode `pdl` (`modeling.ops.pdl`); `norm` =
    (residual, norm_weight, eps, normed out, sum out) turns on the fused residual add + RMSNorm epilogue."""
    m, k = x.shape
    if gated:
        k //= 2
    n = weight.shape[0]
    cnt = split_k_counters(x.device)
    split_k = cfg.split_k
    if triton.cdiv(n, cfg.block_n) >= _NORM_SLOT:
        split_k = 1
    ws = torch.empty((split_k, m, n), dtype=torch.float32, device=x.device) if split_k > 1 else y
    residual, norm_weight, eps, normed, summed = norm if norm is not None else (y, y, 0.0, y, y)
    _skinny_gemm_kernel[(triton.cdiv(n, cfg.block_n), split_k)](
        x, weight, y, ws, cnt, m, n, k, x.stride(0), weight.stride(0), y.stride(0),
        residual, summed, norm_weight, normed, eps,
        BLOCK_M=block_m(m), BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT_K=split_k,
        EVEN_K=(k % (split_k * cfg.block_k) == 0), GATED=gated, NORM=norm is not None, NORM_SLOT=_NORM_SLOT,
        BLOCK_H=triton.next_power_of_2(n) if norm is not None else 16,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **PDL_LAUNCH[pdl])


def linear_with_config(x: torch.Tensor, weight: torch.Tensor, cfg: GemmConfig,
                       out_dtype: torch.dtype | None = None, gated: bool = False, *, pdl: int = 0) -> torch.Tensor:
    """The Triton path with an explicit config (benchmarks, tests). x `[M<=64, K]` (unit last stride),
    weight `[N, K]` (unit last stride), both bf16/fp16 CUDA on one device; returns `[M, N]` in
    `out_dtype` (default x.dtype), launched on the current stream. The split-K workspace is a
    per-call `torch.empty` (graph-pool memory under capture), stream-ordered and freed on return.
    gated: x is `[M, 2K]` (gate then up) and the GEMM input is silu(gate) * up, computed in the kernel."""
    y = torch.empty((x.shape[0], weight.shape[0]), dtype=out_dtype or x.dtype, device=x.device)
    _launch(x, weight, cfg, y, gated, pdl=pdl)
    return y


def linear_add_rms_norm_with_config(x: torch.Tensor, weight: torch.Tensor, cfg: GemmConfig, residual: torch.Tensor,
                                    norm_weight: torch.Tensor, eps: float,
                                    gated: bool = False, *, pdl: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """`linear_with_config` fused with the residual add + RMSNorm that follows it, in one launch: returns
    (rms_norm(y + residual) * norm_weight, y + residual), both new `[M, N]` tensors in x's dtype. residual
    `[M, N]` contiguous and norm_weight `[N]` in x's dtype; y itself is an internal temporary."""
    y = torch.empty((x.shape[0], weight.shape[0]), dtype=x.dtype, device=x.device)
    normed, summed = torch.empty_like(y), torch.empty_like(y)
    _launch(x, weight, cfg, y, gated, (residual, norm_weight, eps, normed, summed), pdl)
    return normed, summed


def _triton_config(x: torch.Tensor, weight: torch.Tensor, gated: bool = False) -> GemmConfig | None:
    """The Triton launch config for x `[M, K]` @ weight `[N, K]`^T, or None where `F.linear` serves: x not 2-D
    CUDA bf16/fp16 with M <= SKINNY_MAX_M, a weight of another dtype or without unit last stride, or a shape
    where cuBLAS measured faster."""
    if (x.dim() != 2 or x.shape[0] > SKINNY_MAX_M or x.dtype not in (torch.bfloat16, torch.float16) or not x.is_cuda
            or weight.stride(1) != 1 or weight.dtype != x.dtype):
        return None
    return config_for(weight.shape[0], weight.shape[1], x.shape[0], x.device, gated)


def linear(x: torch.Tensor, weight: torch.Tensor, *, out_dtype: torch.dtype | None = None, pdl: int = 0,
           gemv: int = triton_gemv.GEMV_DEFAULT_ROWS) -> torch.Tensor:
    """`F.linear(x, weight)` for x `[..., K]`, weight `[N, K]`; the GEMV (`triton_gemv`) where it applies (up to
    `gemv` rows, weights up to GEMV_MAX_N rows, x's dtype out), else the skinny Triton path when x is 2-D CUDA bf16/fp16
    with rows <= SKINNY_MAX_M and weight has unit last stride. `out_dtype` (default x.dtype) is the output
    dtype; the Triton path writes it straight from the fp32 accumulator (fp32 logits), the `F.linear`
    fallback (larger M, fp32, CPU, strided weight) casts its x.dtype result. Call once per device before
    CUDA graph capture (allocates the split-K counters); same-device calls must be stream-ordered. `pdl`: the PDL
    mode of every launch (`modeling.ops.pdl`); `gemv`: the rows up to which the GEMV may serve
    (`KernelOptions.gemv_max_rows()`, 0 = never), as in every operator below."""
    if gemv and (out_dtype is None or out_dtype == x.dtype) and triton_gemv.applies(x, weight, gemv):
        return triton_gemv.gemv(x, weight, pdl=pdl)
    cfg = _triton_config(x, weight)
    if cfg is None:
        y = F.linear(x, weight)
        return y if out_dtype is None or out_dtype == y.dtype else y.to(out_dtype)
    return linear_with_config(x if x.stride(1) == 1 else x.contiguous(), weight, cfg, out_dtype, pdl=pdl)


def router_linear(x: torch.Tensor, weight: torch.Tensor, *, pdl: int = 0,
                  gemv: int = triton_gemv.GEMV_DEFAULT_ROWS) -> torch.Tensor:
    """The MoE router's logits `F.linear(x, weight)`, x `[T, H]`, weight `[E, H]` -> `[T, E]` in x's dtype: the
    GEMV where it applies (up to `gemv` rows; it loads its weight rows before its PDL wait), else `F.linear`
    (cuBLAS). The router's shape is no dense projection's, so it has no tuning-table entry or measured fallback
    for the skinny GEMM."""
    if gemv and triton_gemv.applies(x, weight, gemv):
        return triton_gemv.gemv(x, weight, pdl=pdl)
    return F.linear(x, weight)


def silu_mul_linear(x: torch.Tensor, weight: torch.Tensor, *, pdl: int = 0,
                    gemv: int = triton_gemv.GEMV_DEFAULT_ROWS) -> torch.Tensor:
    """`linear(silu_and_mul(x), weight)` for x `[M, 2K]` (gate then up), weight `[N, K]`: one kernel (the SiLU-gate
    in the GEMM's prologue, no `[M, K]` intermediate) where `linear` would take the Triton path, else the two
    operators. Same bits as the unfused pair: the prologue rounds like `silu_and_mul`."""
    if x.dim() != 2 or x.shape[-1] != 2 * weight.shape[-1]:
        raise ValueError(f"silu_mul_linear: x {tuple(x.shape)} must be [M, 2K] for weight {tuple(weight.shape)}")
    cfg = _triton_config(x, weight, gated=True)
    if cfg is None:
        return linear(silu_and_mul(x, pdl=pdl), weight, pdl=pdl, gemv=gemv)
    return linear_with_config(x if x.stride(1) == 1 else x.contiguous(), weight, cfg, gated=True, pdl=pdl)


def linear_add_rms_norm(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor,
                        eps: float, *, gated: bool = False, pdl: int = 0,
                        gemv: int = triton_gemv.GEMV_DEFAULT_ROWS) -> tuple[torch.Tensor, torch.Tensor]:
    """`add_rms_norm(linear(x, weight), residual, norm_weight, eps)` (gated: `silu_mul_linear(x, weight)`):
    (normed `[M, N]`, sum `[M, N]`). One kernel where the GEMM takes the Triton path, M <= FUSED_NORM_MAX_M,
    N <= FUSED_NORM_MAX_N and residual/norm_weight match x's dtype; else the GEMM and `add_rms_norm` kernels.
    Rounded like the unfused pair; the fp32 sum of squares may be ordered differently."""
    n = weight.shape[0]
    if gated and (x.dim() != 2 or x.shape[-1] != 2 * weight.shape[-1]):
        raise ValueError(f"linear_add_rms_norm: gated x {tuple(x.shape)} must be [M, 2K] for weight {tuple(weight.shape)}")
    cfg = _triton_config(x, weight, gated)
    if gated and cfg is None:
        cfg = _triton_config(x, weight)
        if cfg is not None:  # the gated prologue measured slower than the separate kernel here
            x, gated = silu_and_mul(x, pdl=pdl), False
    if (cfg is None or not fuses_norm(x.shape[0], n) or residual.shape != (x.shape[0], n)
            or residual.dtype != x.dtype or norm_weight.shape != (n,) or norm_weight.dtype != x.dtype):
        y = silu_mul_linear(x, weight, pdl=pdl, gemv=gemv) if gated else linear(x, weight, pdl=pdl, gemv=gemv)
        return add_rms_norm(y, residual, norm_weight, eps, pdl=pdl)
    x = x if x.stride(1) == 1 else x.contiguous()
    return linear_add_rms_norm_with_config(x, weight, cfg, residual.contiguous(), norm_weight.contiguous(), eps,
                                           gated=gated, pdl=pdl)


def norm_linear(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                weight: torch.Tensor, *, gated: bool = False, pdl: int = 0,
                gemv: int = triton_gemv.GEMV_DEFAULT_ROWS) -> tuple[torch.Tensor, torch.Tensor]:
    """(linear(rms_norm(x + residual) * norm_weight, weight), x + residual): the projection with the residual add
    and RMSNorm before it (residual None: the norm of x, and x itself as the stream); gated: weight `[2N, K]`
    (gate then up) and the first output is silu_and_mul of the projection, `[M, N]`. One GEMV launch where
    `triton_gemv.applies` (up to `gemv` rows), residual `[M, K]` and norm_weight `[K]` matching x's dtype; else the
    norm, linear and silu_and_mul kernels. Rounded like the unfused operators; fp32 sums may be ordered differently."""
    if gated and weight.shape[0] % 2:
        raise ValueError(f"norm_linear: gated weight {tuple(weight.shape)} needs an even number of rows (gate, up)")
    if _gemv_takes_norm(x, residual, norm_weight, weight, gemv):
        return triton_gemv.norm_gemv(x, residual, norm_weight, eps, weight, gated, pdl=pdl)
    normed, summed = _norm_rows(x, residual, norm_weight, eps, pdl)
    y = linear(normed, weight, pdl=pdl, gemv=gemv)
    return (silu_and_mul(y, pdl=pdl) if gated else y), summed


def _gemv_takes_norm(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, weight: torch.Tensor,
                     gemv: int) -> bool:
    """Whether one GEMV launch serves the norm before this projection: `triton_gemv.applies` (up to `gemv` rows),
    residual `[M, K]` and norm_weight `[K]` matching x's dtype."""
    k = x.shape[-1]
    return bool(gemv and triton_gemv.applies(x, weight, gemv) and norm_weight.shape == (k,)
                and norm_weight.dtype == x.dtype
                and (residual is None or (residual.shape == x.shape and residual.dtype == x.dtype)))


def _norm_rows(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
               pdl: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(normed, stream) by the norm kernels: rms_norm(x) and x itself, or add_rms_norm(x, residual)."""
    if residual is None:
        return rms_norm(x, norm_weight, eps, pdl=pdl), x
    return add_rms_norm(x, residual, norm_weight, eps, pdl=pdl)


def norm_linear_normed(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                       weight: torch.Tensor, *, pdl: int = 0,
                       gemv: int = triton_gemv.GEMV_DEFAULT_ROWS) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(linear(normed, weight), normed, x + residual) with normed = rms_norm(x + residual) * norm_weight: `norm_linear`
    (ungated) that also returns the normed rows, for a consumer besides the projection (the MoE experts after their
    router). One GEMV launch where `triton_gemv.applies` (up to `gemv` rows), else the norm kernel and `F.linear`
    (cuBLAS: the projections that take this are routers, which have no skinny-GEMM table entry)."""
    if _gemv_takes_norm(x, residual, norm_weight, weight, gemv):
        normed = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        y, summed = triton_gemv.norm_gemv(x, residual, norm_weight, eps, weight, pdl=pdl, normed_out=normed)
        return y, normed, summed
    normed, summed = _norm_rows(x, residual, norm_weight, eps, pdl)
    return F.linear(normed, weight), normed, summed
