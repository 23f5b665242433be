"""Triton split-KV decode attention ("flash decoding") over the paged KV cache.

Shapes: q `[B, Hq, D]` (last dim contiguous), caches `[N, bs, Hkv, D]`
(bf16, fp16 or fp32, same dtype as q), block_tables int32 `[B, W]`,
kv_seqlens int32 `[B]`; returns `[B, Hq, D]` in q's dtype. Hq = group * Hkv.

`_decode_split_kernel` runs on the static grid `(B, Hkv, S)`: program (b, h, s)
takes all `group` query heads of KV head h together (padded to >= 16 rows for
tl.dot) over its share of sequence b's KV tiles, the share computed in-kernel
from kv_seqlens. With S == 1 it writes the output directly. With S > 1 it writes
a normalised partial output and its log2-sum-exp to fp32 scratch
(`[B, Hq, S, D]`, `[B, Hq, S]`), and the S partials of (b, h) are combined in
the fixed order s = 0..S-1 (`_combine_splits`), either
- in the same launch (default): each program that owns a tile (split 0 alone for
  an empty sequence) bumps the int32 arrival counter of (b, h) (acq_rel, gpu
  scope); the one that arrives last combines, writes the output and resets the
  counter to 0. The other splits exit at once: a short context in a graph
  captured for the longest one pays no atomics for its empty splits; or
- by a second launch, `_decode_reduce_kernel` on grid `(B, Hkv)` (the fallback
  when B * Hkv exceeds the counter slots, or with `single_launch=False`).
Both give the same bits. With `DecodeConfig.prefetch` each program loads the length, its first tile's block-table
entries and, when every token of that tile precedes the step's new one (the only cache row the step's kernels
write), the tile's K and V before its PDL wait, then attends that tile first; the bits do not change.
S depends only on (B, Hkv, W, bs, SM count), never on
live lengths, and nothing here synchronises with the host: the call can be
captured in a CUDA graph and replayed with other lengths and block tables.

Process-wide state (documented exception to the no-global-state rule, as in
`triton_gemm`): one zero-initialised int32 counter tensor per device,
`_COUNTER_SLOTS` entries (slot b * Hkv + h), allocated by the first
`decode_attention` call on that device, which must run outside CUDA graph
capture (the warm-up before every capture guarantees it; a capture that would
allocate raises `DecodeNotWarmedUpError`). Every launch leaves the counters at
zero. All calls share them, so decode launches on one device must be stream-
ordered (one forward stream per rank, as the runner does): two launches running
concurrently on different streams of one device are unsupported.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from modeling.ops.pdl import PDL_LAUNCH, pdl_launch_dependents, pdl_wait
from modeling.ops.triton_decode_config import (COMBINE_CHUNK, LOG2E, MAX_SPLITS, PREFETCH_MAX_BATCH,  # noqa: F401
                                              TARGET_WAVES,
                                              _COUNTER_SLOTS, DecodeConfig, DecodeNotWarmedUpError, _counters,
                                              _sm_count, decode_config, decode_counters, device_sm_count)


@triton.jit
def _active_splits(kv_len, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr):
    """Splits of a kv_len-token sequence that own >= 1 tile; they are the first ones (0 for kv_len == 0)."""
    n_tiles = tl.cdiv(kv_len, BLOCK_N)
    per_split = tl.maximum(tl.cdiv(n_tiles, NUM_SPLITS), 1)
    return tl.cdiv(n_tiles, per_split)


@triton.jit
def _combine_splits(PART_O, PART_LSE, OUT, b, kvh, n_active, stride_ob, stride_oh,
                    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr,
                    BLOCK_H: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_D: tl.constexpr,
                    CACHE: tl.constexpr):
    """Write the output rows of KV head `kvh`'s GROUP query heads of sequence b from their split partials.

    out = sum_s w_s * o_s / sum_s w_s with w_s = exp2(lse_s - max lse), accumulated in the fixed order
    s = 0, 1, .. over the first `n_active` splits only (empty splits write nothing and are not read; masked
    slots of the last chunk add exact zeros); zeros when n_active == 0. The data meet only elementwise ops and
    a max, so the bits do not depend on the layout the calling kernel gives them. Splits are read BLOCK_C at a
    time: one memory round trip per chunk, registers bounded by the chunk.
    """
    offs_h = tl.arange(0, BLOCK_H)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    h_mask = offs_h < GROUP
    d_mask = offs_d < HEAD_DIM
    heads = kvh * GROUP + offs_h
    rows = (b.to(tl.int64) * (GROUP * tl.num_programs(1)) + heads) * NUM_SPLITS  # split 0 of each head
    lse_all = tl.load(PART_LSE + rows[:, None] + offs_s[None, :], mask=h_mask[:, None] & (offs_s < n_active)[None, :],
                      other=float("-inf"), cache_modifier=CACHE)
    m = tl.max(lse_all, 1)
    m = tl.where(m == float("-inf"), 0.0, m)
    num = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    den = tl.zeros([BLOCK_H], dtype=tl.float32)
    for c in range(0, n_active, BLOCK_C):  # BLOCK_C independent loads in flight, then their fixed-order sum
        for j in tl.static_range(BLOCK_C):
            live = offs_h < tl.where(n_active > c + j, GROUP, 0)  # h_mask & (split c + j < n_active)
            w = tl.exp2(tl.load(PART_LSE + rows + c + j, mask=live, other=float("-inf"), cache_modifier=CACHE) - m)
            part = tl.load(PART_O + (rows + c + j)[:, None] * HEAD_DIM + offs_d[None, :],
                           mask=live[:, None] & d_mask[None, :], other=0.0, cache_modifier=CACHE)
            num += part * w[:, None]
            den += w
    out = num / tl.where(den > 0.0, den, 1.0)[:, None]
    o_ptrs = OUT + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, out.to(OUT.dtype.element_ty), mask=h_mask[:, None] & d_mask[None, :])


@triton.jit
def _load_kv_tile(base, page, row, offs_d, stride_b, stride_t, mask):
    """A `[BLOCK_N, BLOCK_D]` tile of one KV head's cache: token i at `row[i]` of cache block `page[i]` (int64
    `[BLOCK_N]` and `[BLOCK_N, 1]`), zeros where `mask` is false."""
    return tl.load(base + page[:, None] * stride_b + row * stride_t + offs_d[None, :], mask=mask, other=0.0)


@triton.jit
def _attend_tile(q, k, v, n_mask, m_i, l_i, acc, qk_scale, PRECISION: tl.constexpr):
    """One KV tile into the running softmax state: q `[BLOCK_G, BLOCK_D]`, k and v `[BLOCK_N, BLOCK_D]` (cache
    dtype, zeros where masked), n_mask `[BLOCK_N]` the tile's live tokens; m_i / l_i `[BLOCK_G]` and acc
    `[BLOCK_G, BLOCK_D]` fp32. Returns the new (m_i, l_i, acc)."""
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # fp32 scalar argument
    s = tl.where(n_mask[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i, acc


# Per-step metadata (block-table width, where the lengths and tables live) must not pick a new compiled variant.
@triton.jit(do_not_specialize=["stride_bt", "table_width"], do_not_specialize_on_alignment=["BLOCK_TABLES", "KV_LENS"])
def _decode_split_kernel(
    Q,
    K_CACHE,
    V_CACHE,
    BLOCK_TABLES,
    KV_LENS,
    OUT,
    PART_O,
    PART_LSE,
    COUNTERS,
    qk_scale,
    stride_qb,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_bt,
    table_width,
    stride_ob,
    stride_oh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SINGLE_LAUNCH: tl.constexpr,
    PREFETCH: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_launch_dependents(PDL)
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    if BLOCK_D == HEAD_DIM:
        d_mask = offs_d < BLOCK_D
    else:
        d_mask = offs_d < HEAD_DIM
    table = BLOCK_TABLES + b.to(tl.int64) * stride_bt
    k_base = K_CACHE + kvh * stride_kh
    v_base = V_CACHE + kvh * stride_vh
    if not PREFETCH:
        pdl_wait(PDL)  # before the early exit below too (`modeling.ops.pdl`, rule 3)
    # With PREFETCH, before the wait (`modeling.ops.pdl`, rule 2): the lengths and block tables (host copies ahead of
    # the step's kernels) and the first tile's K and V when every token of it precedes the step's new one (the only
    # cache row a kernel of this step writes, at kv_len - 1). The table read also stays inside the row.
    kv_len = tl.load(KV_LENS + b)
    n_tiles = tl.cdiv(kv_len, BLOCK_N)
    per_split = tl.cdiv(n_tiles, NUM_SPLITS)
    t_begin = split * per_split
    t_end = tl.minimum(t_begin + per_split, n_tiles)
    if PREFETCH:
        tok0 = t_begin * BLOCK_N + offs_n
        # scalar conditions enter the masks through their bounds (the interpreter masks with tensors only)
        n_mask0 = (tok0 < tl.where(t_begin < t_end, kv_len, 0)) & (tok0 // PAGE < table_width)
        page0 = tl.load(table + tok0 // PAGE, mask=n_mask0, other=0).to(tl.int64)
        row0 = (tok0 % PAGE)[:, None]
        kv_mask0 = n_mask0[:, None] & d_mask[None, :]
        # early: every token of the tile precedes the new one, so its K and V load now
        early = (offs_n < tl.where(t_begin * BLOCK_N + BLOCK_N < kv_len, BLOCK_N, 0))[:, None]
        k0 = _load_kv_tile(k_base, page0, row0, offs_d, stride_kb, stride_kt, kv_mask0 & early)
        v0 = _load_kv_tile(v_base, page0, row0, offs_d, stride_vb, stride_vt, kv_mask0 & early)
        pdl_wait(PDL)  # before the early exit below too (rule 3)
    n_active = _active_splits(kv_len, BLOCK_N, NUM_SPLITS)
    n_arrive = tl.maximum(n_active, 1)  # split 0 closes an empty sequence's count and writes its zeros
    if NUM_SPLITS > 1:
        if not SINGLE_LAUNCH:
            if t_begin >= t_end:
                return  # the reduce kernel never reads empty splits
        elif split >= n_arrive:
            return  # owns no tile: writes nothing, and the last of the first n_arrive splits combines

    heads = kvh * GROUP + offs_g
    g_mask = offs_g < GROUP
    q = tl.load(
        Q + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
        mask=g_mask[:, None] & d_mask[None, :],
        other=0.0,
    )

    m_i = tl.full([BLOCK_G], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    t_loop = t_begin
    if PREFETCH:
        if t_begin < t_end:  # the first tile, its K and V from before the wait unless it holds the new token
            k_late = _load_kv_tile(k_base, page0, row0, offs_d, stride_kb, stride_kt, kv_mask0 & ~early)
            v_late = _load_kv_tile(v_base, page0, row0, offs_d, stride_vb, stride_vt, kv_mask0 & ~early)
            m_i, l_i, acc = _attend_tile(q, tl.where(early, k0, k_late), tl.where(early, v0, v_late), n_mask0,
                                         m_i, l_i, acc, qk_scale, PRECISION)
        t_loop = t_begin + 1
    # no trip for an empty split of the single launch; NUM_STAGES > 1 software-pipelines the tiles' loads (a plain
    # `range` is not pipelined here: the loop sits under the early exits' branches)
    for t in tl.range(t_loop, t_end, num_stages=NUM_STAGES):
        tok = t * BLOCK_N + offs_n
        n_mask = tok < kv_len
        page = tl.load(table + tok // PAGE, mask=n_mask, other=0).to(tl.int64)
        row = (tok % PAGE)[:, None]
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = _load_kv_tile(k_base, page, row, offs_d, stride_kb, stride_kt, kv_mask)
        v = _load_kv_tile(v_base, page, row, offs_d, stride_vb, stride_vt, kv_mask)
        m_i, l_i, acc = _attend_tile(q, k, v, n_mask, m_i, l_i, acc, qk_scale, PRECISION)

    out_mask = g_mask[:, None] & d_mask[None, :]
    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        o_ptrs = OUT + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, out.to(OUT.dtype.element_ty), mask=out_mask)
    else:
        # scratch is contiguous [B, Hq, NUM_SPLITS, HEAD_DIM] and [B, Hq, NUM_SPLITS]
        row_id = (b.to(tl.int64) * (GROUP * tl.num_programs(1)) + heads) * NUM_SPLITS + split
        if t_begin < t_end:  # empty splits write nothing: the combine reads only the first n_active splits
            out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
            tl.store(PART_O + row_id[:, None] * HEAD_DIM + offs_d[None, :], out, mask=out_mask)
            tl.store(PART_LSE + row_id, m_i + tl.log2(l_i), mask=g_mask)
        if SINGLE_LAUNCH:
            slot = b * tl.num_programs(1) + kvh
            # All threads' partial stores precede the (single-thread) release of the counter increment.
            tl.debug_barrier()
            arrived = tl.atomic_add(COUNTERS + slot, 1, sem="acq_rel", scope="gpu")
            if arrived == n_arrive - 1:
                # Last arrival: its acquire saw every other program's release; .cg reads bypass L1.
                _combine_splits(PART_O, PART_LSE, OUT, b, kvh, n_active, stride_ob,
                                stride_oh, GROUP, HEAD_DIM, NUM_SPLITS, BLOCK_H, BLOCK_S, BLOCK_C, BLOCK_D, ".cg")
                tl.store(COUNTERS + slot, 0)  # every counting program of (b, h) arrived: nobody reads it this launch


@triton.jit
def _decode_reduce_kernel(
    PART_O,
    PART_LSE,
    KV_LENS,
    OUT,
    stride_ob,
    stride_oh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    n_active = _active_splits(tl.load(KV_LENS + b), BLOCK_N, NUM_SPLITS)
    _combine_splits(PART_O, PART_LSE, OUT, b, kvh, n_active, stride_ob, stride_oh,
                    GROUP, HEAD_DIM, NUM_SPLITS, BLOCK_H, BLOCK_S, BLOCK_C, BLOCK_D, "")


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    kv_seqlens: torch.Tensor,
    scale: float,
    *,
    config: DecodeConfig | None = None,
    single_launch: bool = True,
    prefetch: bool | None = None,
    pdl: int = 0,
) -> torch.Tensor:
    """One query token per sequence (`q`: `[B, Hq, D]`) over its whole cached context; returns `[B, Hq, D]`.

    `config` overrides the static heuristic (benchmarks); it must not depend on live lengths.
    `single_launch` (`KernelOptions.decode_single_launch`, default on) combines the splits in the split
    kernel's last-arriving program; False (or
    B * Hkv > `_COUNTER_SLOTS`) launches `_decode_reduce_kernel` instead; both give the same bits. Launched on
    the current stream; scratch is a per-call `torch.empty` (graph-pool memory under capture). The first call
    on a device allocates its arrival counters and must run outside CUDA graph capture; calls on one device
    must be stream-ordered (see the module docstring). `pdl`: the split kernel's PDL mode (`modeling.ops.pdl`).
    `prefetch` (`KernelOptions.decode_prefetch`): None takes the config's choice (`DecodeConfig.prefetch`); True or
    False forces the loads before the PDL wait on or off. Same bits either way.
    """
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    if num_q_heads % num_kv_heads != 0:
        raise ValueError(f"decode_attention: Hq={num_q_heads} is not a multiple of Hkv={num_kv_heads}")
    if k_cache.shape != v_cache.shape or k_cache.shape[3] != head_dim:
        raise ValueError(f"decode_attention: caches {tuple(k_cache.shape)} do not fit q {tuple(q.shape)}")
    if q.stride(-1) != 1:
        q = q.contiguous()
    counters = decode_counters(q.device)  # every call, so any warm-up allocates them before capture
    group = num_q_heads // num_kv_heads
    page = k_cache.shape[1]
    cfg = config or decode_config(
        batch, num_kv_heads, block_tables.shape[1], page, head_dim, k_cache.dtype, device_sm_count(q.device)
    )
    out = torch.empty((batch, num_q_heads, head_dim), dtype=q.dtype, device=q.device)
    if batch == 0:
        return out
    splits = cfg.num_splits
    single_launch = single_launch and splits > 1 and batch * num_kv_heads <= counters.numel()
    if splits > 1:
        part_o = torch.empty((batch, num_q_heads, splits, head_dim), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((batch, num_q_heads, splits), dtype=torch.float32, device=q.device)
    else:
        part_o = part_lse = out  # unused by the kernel when NUM_SPLITS == 1
    block_h = triton.next_power_of_2(group)
    block_s = triton.next_power_of_2(splits)
    block_c = min(block_s, COMBINE_CHUNK)
    block_d = triton.next_power_of_2(head_dim)
    _decode_split_kernel[(batch, num_kv_heads, splits)](
        q,
        k_cache,
        v_cache,
        block_tables,
        kv_seqlens,
        out,
        part_o,
        part_lse,
        counters,
        scale * LOG2E,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        block_tables.stride(0),
        block_tables.shape[1],
        out.stride(0),
        out.stride(1),
        GROUP=group,
        HEAD_DIM=head_dim,
        PAGE=page,
        NUM_SPLITS=splits,
        SINGLE_LAUNCH=single_launch,
        PREFETCH=cfg.prefetch if prefetch is None else bool(prefetch),
        NUM_STAGES=cfg.num_stages,
        BLOCK_G=max(16, block_h),
        BLOCK_N=cfg.block_n,
        BLOCK_H=block_h,
        BLOCK_S=block_s,
        BLOCK_C=block_c,
        BLOCK_D=block_d,
        PRECISION="ieee" if k_cache.dtype == torch.float32 else "tf32",
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **PDL_LAUNCH[pdl],
    )
    if splits > 1 and not single_launch:
        _decode_reduce_kernel[(batch, num_kv_heads)](
            part_o,
            part_lse,
            kv_seqlens,
            out,
            out.stride(0),
            out.stride(1),
            GROUP=group,
            HEAD_DIM=head_dim,
            NUM_SPLITS=splits,
            BLOCK_N=cfg.block_n,
            BLOCK_H=block_h,
            BLOCK_S=block_s,
            BLOCK_C=block_c,
            BLOCK_D=block_d,
            num_warps=4,
        )
    return out


__all__ = ["DecodeConfig", "DecodeNotWarmedUpError", "decode_attention", "decode_config", "decode_counters",
           "device_sm_count", "LOG2E"]
