"""Triton causal prefill attention over the paged KV cache (flash attention).

Shapes: q `[T, Hq, D]` (last dim contiguous), caches `[N, bs, Hkv, D]` (bf16,
fp16 or fp32, same dtype as q), q_start_loc / q_seqlens / kv_seqlens int32
`[B]`, block_tables int32 `[B, W]`; returns `[T, Hq, D]` in q's dtype with rows
past the real tokens zero. Sequence b's q_len new tokens sit at positions
kv_len - q_len .. kv_len - 1 and their K/V are already stored in the cache.

Grid `(Hq, cdiv(max_q, BLOCK_M), B)`: static for a given q shape when max_q is
not given (max_q = T). Programs past their sequence's q_len exit at once;
the longest (last) query tiles of a sequence run first.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from modeling.ops.triton_decode import LOG2E


# Upper query-length bounds of `prefill_config`'s bf16/fp16 tile tiers (the last tier has none); the warm-up compiles
# one variant per tier from these (`triton_attention.attention_warm_up_calls`).
SMALL_MAX_Q, MID_MAX_Q = 16, 512


@dataclass(frozen=True)
class PrefillConfig:
    """Static launch parameters of the prefill kernel."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


def prefill_config(max_q: int, head_dim: int, dtype: torch.dtype) -> PrefillConfig:
    """Pick tile sizes from static facts (head dim, dtype, query-length bound)."""
    if dtype == torch.float32:
        return PrefillConfig(block_m=32, block_n=32, num_warps=4, num_stages=2)
    if head_dim > 128:
        return PrefillConfig(block_m=64, block_n=32, num_warps=4, num_stages=2)
    if max_q <= SMALL_MAX_Q:
        return PrefillConfig(block_m=16, block_n=64, num_warps=4, num_stages=3)
    if max_q <= MID_MAX_Q:
        return PrefillConfig(block_m=64, block_n=64, num_warps=4, num_stages=3)
    # `python -m bench.prefill_attn_tune` on an H100 (docs/benchmarks.md, twenty-third session): 128 x 128 tiles beat
    # the former 128 x 64 by 3.5-13% from 2048 tokens up, with and without history; 64 x 64 led at 512
    return PrefillConfig(block_m=128, block_n=128, num_warps=8, num_stages=3)


@triton.jit
def _attend_tile(
    q,
    acc,
    m_i,
    l_i,
    t,
    q_pos,
    kv_len,
    table,
    k_base,
    v_base,
    offs_n,
    offs_d,
    d_mask,
    qk_scale,
    stride_kb,
    stride_kt,
    stride_vb,
    stride_vt,
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL_MASK: tl.constexpr,
    PRECISION: tl.constexpr,
):
    tok = t * BLOCK_N + offs_n
    n_mask = tok < kv_len
    page = tl.load(table + tok // PAGE, mask=n_mask, other=0).to(tl.int64)
    row = (tok % PAGE)[:, None]
    kv_mask = n_mask[:, None] & d_mask[None, :]
    k = tl.load(k_base + page[:, None] * stride_kb + row * stride_kt + offs_d[None, :], mask=kv_mask, other=0.0)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale.to(tl.float32)
    if CAUSAL_MASK:
        s = tl.where((tok[None, :] <= q_pos[:, None]) & n_mask[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_base + page[:, None] * stride_vb + row * stride_vt + offs_d[None, :], mask=kv_mask, other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return acc, m_new, l_i


# Per-step metadata (block-table width, where the lengths and tables live) must not pick a new compiled variant.
@triton.jit(do_not_specialize=["stride_bt"],
            do_not_specialize_on_alignment=["Q_START", "Q_LENS", "KV_LENS", "BLOCK_TABLES"])
def _prefill_kernel(
    Q,
    K_CACHE,
    V_CACHE,
    OUT,
    Q_START,
    Q_LENS,
    KV_LENS,
    BLOCK_TABLES,
    qk_scale,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_bt,
    stride_ot,
    stride_oh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr,
):
    h = tl.program_id(0)
    mb = tl.program_id(1)
    b = tl.program_id(2)
    q_len = tl.load(Q_LENS + b)
    n_mblocks = tl.cdiv(q_len, BLOCK_M)
    if mb >= n_mblocks:
        return
    mb = n_mblocks - 1 - mb
    kv_len = tl.load(KV_LENS + b)
    q_start = tl.load(Q_START + b)
    history = kv_len - q_len

    offs_m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    m_mask = offs_m < q_len
    if BLOCK_D == HEAD_DIM:
        d_mask = offs_d < BLOCK_D
    else:
        d_mask = offs_d < HEAD_DIM
    q_rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(
        Q + q_rows[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
        mask=m_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    q_pos = history + offs_m
    kvh = h // GROUP
    table = BLOCK_TABLES + b.to(tl.int64) * stride_bt
    k_base = K_CACHE + kvh * stride_kh
    v_base = V_CACHE + kvh * stride_vh

    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    # tiles wholly at or before the tile's first query position need no mask
    first_pos = history + mb * BLOCK_M
    last_pos = history + tl.minimum(mb * BLOCK_M + BLOCK_M, q_len) - 1
    n_full = (first_pos + 1) // BLOCK_N
    n_tiles = last_pos // BLOCK_N + 1
    for t in range(0, n_full):
        acc, m_i, l_i = _attend_tile(
            q, acc, m_i, l_i, t, q_pos, kv_len, table, k_base, v_base, offs_n, offs_d, d_mask, qk_scale,
            stride_kb, stride_kt, stride_vb, stride_vt, PAGE, BLOCK_N, False, PRECISION,
        )  # fmt: skip
    for t in range(n_full, n_tiles):
        acc, m_i, l_i = _attend_tile(
            q, acc, m_i, l_i, t, q_pos, kv_len, table, k_base, v_base, offs_n, offs_d, d_mask, qk_scale,
            stride_kb, stride_kt, stride_vb, stride_vt, PAGE, BLOCK_N, True, PRECISION,
        )  # fmt: skip

    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    o_ptrs = OUT + q_rows[:, None] * stride_ot + h * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, out.to(OUT.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


def prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    q_start_loc: torch.Tensor,
    q_seqlens: torch.Tensor,
    kv_seqlens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    *,
    max_q_seqlen: int | None = None,
    config: PrefillConfig | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its cached history and themselves.

    KV for the new tokens must already be stored. `max_q_seqlen` (host int, an upper
    bound of q_seqlens) tightens the grid; without it the bound is T. Rows past the
    real tokens are zero.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    if num_q_heads % num_kv_heads != 0:
        raise ValueError(f"prefill_attention: Hq={num_q_heads} is not a multiple of Hkv={num_kv_heads}")
    if k_cache.shape != v_cache.shape or k_cache.shape[3] != head_dim:
        raise ValueError(f"prefill_attention: caches {tuple(k_cache.shape)} do not fit q {tuple(q.shape)}")
    if q.stride(-1) != 1:
        q = q.contiguous()
    out = torch.zeros((num_tokens, num_q_heads, head_dim), dtype=q.dtype, device=q.device)
    batch = q_seqlens.shape[0]
    max_q = num_tokens if max_q_seqlen is None else min(max_q_seqlen, num_tokens)
    if batch == 0 or max_q == 0:
        return out
    cfg = config or prefill_config(max_q, head_dim, k_cache.dtype)
    grid = (num_q_heads, triton.cdiv(max_q, cfg.block_m), batch)
    _prefill_kernel[grid](
        q,
        k_cache,
        v_cache,
        out,
        q_start_loc,
        q_seqlens,
        kv_seqlens,
        block_tables,
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
        out.stride(0),
        out.stride(1),
        GROUP=num_q_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        PAGE=k_cache.shape[1],
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_D=triton.next_power_of_2(head_dim),
        PRECISION="ieee" if k_cache.dtype == torch.float32 else "tf32",
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return out


__all__ = ["PrefillConfig", "prefill_config", "prefill_attention"]
