"""Triton split-KV decode attention ("flash decoding") over the paged KV cache.

Shapes: q `[B, Hq, D]` (last dim contiguous), caches `[N, bs, Hkv, D]`
(bf16, fp16 or fp32, same dtype as q), block_tables int32 `[B, W]`,
kv_seqlens int32 `[B]`; returns `[B, Hq, D]` in q's dtype. Hq = group * Hkv.

Kernel 1 runs on the static grid `(B, Hkv, S)`: program (b, h, s) takes all
`group` query heads of KV head h together (padded to >= 16 rows for tl.dot)
over its share of sequence b's KV tiles, the share computed in-kernel from
kv_seqlens. With S > 1 it writes a normalised partial output and its log2-sum-
exp to fp32 scratch and kernel 2 combines the splits; with S == 1 it writes
the output directly. S depends only on (B, Hkv, W, bs, SM count), never on
live lengths, and nothing here synchronises with the host: the call can be
captured in a CUDA graph and replayed with other lengths and block tables.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
TARGET_WAVES = 4  # aim for about this many programs per SM in kernel 1
MAX_SPLITS = 64


@dataclass(frozen=True)
class DecodeConfig:
    """Static launch parameters of the decode kernels."""

    block_n: int
    num_splits: int
    num_warps: int
    num_stages: int


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def device_sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of `device`; a fixed stand-in on CPU (Triton interpreter)."""
    if device.type != "cuda":
        return 132
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def decode_config(
    batch: int,
    num_kv_heads: int,
    max_blocks_per_seq: int,
    block_size: int,
    head_dim: int,
    dtype: torch.dtype,
    sm_count: int,
) -> DecodeConfig:
    """Pick tile size and split count from static shapes only (CUDA-graph safe)."""
    block_n = 32 if dtype == torch.float32 or head_dim > 128 else 64
    max_tiles = max(1, -(-max_blocks_per_seq * block_size // block_n))
    programs = max(1, batch * num_kv_heads)
    # powers of two bound the number of compiled variants across batch buckets
    splits = min(triton.next_power_of_2(-(-TARGET_WAVES * sm_count // programs)), MAX_SPLITS, max_tiles)
    num_stages = 3 if head_dim <= 128 and dtype != torch.float32 else 2
    return DecodeConfig(block_n=block_n, num_splits=splits, num_warps=4, num_stages=num_stages)


@triton.jit
def _decode_split_kernel(
    Q,
    K_CACHE,
    V_CACHE,
    BLOCK_TABLES,
    KV_LENS,
    OUT,
    PART_O,
    PART_LSE,
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
    stride_ob,
    stride_oh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    kv_len = tl.load(KV_LENS + b)
    n_tiles = tl.cdiv(kv_len, BLOCK_N)
    per_split = tl.cdiv(n_tiles, NUM_SPLITS)
    t_begin = split * per_split
    t_end = tl.minimum(t_begin + per_split, n_tiles)
    if NUM_SPLITS > 1:
        if t_begin >= t_end:
            return  # the reduce kernel never reads empty splits

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    heads = kvh * GROUP + offs_g
    g_mask = offs_g < GROUP
    if BLOCK_D == HEAD_DIM:
        d_mask = offs_d < BLOCK_D
    else:
        d_mask = offs_d < HEAD_DIM
    q = tl.load(
        Q + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
        mask=g_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    table = BLOCK_TABLES + b.to(tl.int64) * stride_bt
    k_base = K_CACHE + kvh * stride_kh
    v_base = V_CACHE + kvh * stride_vh

    m_i = tl.full([BLOCK_G], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    for t in range(t_begin, t_end):
        tok = t * BLOCK_N + offs_n
        n_mask = tok < kv_len
        page = tl.load(table + tok // PAGE, mask=n_mask, other=0).to(tl.int64)
        row = (tok % PAGE)[:, None]
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_base + page[:, None] * stride_kb + row * stride_kt + offs_d[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale.to(tl.float32)
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + page[:, None] * stride_vb + row * stride_vt + offs_d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    out_mask = g_mask[:, None] & d_mask[None, :]
    if NUM_SPLITS == 1:
        o_ptrs = OUT + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, out.to(OUT.dtype.element_ty), mask=out_mask)
    else:
        # scratch is contiguous [B, Hq, NUM_SPLITS, HEAD_DIM] and [B, Hq, NUM_SPLITS]
        row_id = (b.to(tl.int64) * (GROUP * tl.num_programs(1)) + heads) * NUM_SPLITS + split
        tl.store(PART_O + row_id[:, None] * HEAD_DIM + offs_d[None, :], out, mask=out_mask)
        tl.store(PART_LSE + row_id, m_i + tl.log2(l_i), mask=g_mask)


@triton.jit
def _decode_reduce_kernel(
    PART_O,
    PART_LSE,
    KV_LENS,
    OUT,
    stride_ob,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    kv_len = tl.load(KV_LENS + b)
    n_tiles = tl.cdiv(kv_len, BLOCK_N)
    per_split = tl.maximum(tl.cdiv(n_tiles, NUM_SPLITS), 1)
    n_active = tl.cdiv(n_tiles, per_split)

    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < n_active
    d_mask = offs_d < HEAD_DIM
    row_id = (b.to(tl.int64) * tl.num_programs(1) + h) * NUM_SPLITS + offs_s
    lse = tl.load(PART_LSE + row_id, mask=s_mask, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m)
    parts = tl.load(PART_O + row_id[:, None] * HEAD_DIM + offs_d[None, :], mask=s_mask[:, None] & d_mask[None, :], other=0.0)
    num = tl.sum(parts * w[:, None], 0)
    den = tl.sum(w, 0)
    out = num / tl.where(den > 0.0, den, 1.0)  # no active split (kv_len 0): zeros
    tl.store(OUT + b.to(tl.int64) * stride_ob + h * stride_oh + offs_d, out.to(OUT.dtype.element_ty), mask=d_mask)


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    kv_seqlens: torch.Tensor,
    scale: float,
    *,
    config: DecodeConfig | None = None,
) -> torch.Tensor:
    """One query token per sequence (`q`: `[B, Hq, D]`) over its whole cached context.

    `config` overrides the static heuristic (benchmarks); it must not depend on live lengths.
    """
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    if num_q_heads % num_kv_heads != 0:
        raise ValueError(f"decode_attention: Hq={num_q_heads} is not a multiple of Hkv={num_kv_heads}")
    if k_cache.shape != v_cache.shape or k_cache.shape[3] != head_dim:
        raise ValueError(f"decode_attention: caches {tuple(k_cache.shape)} do not fit q {tuple(q.shape)}")
    if q.stride(-1) != 1:
        q = q.contiguous()
    group = num_q_heads // num_kv_heads
    page = k_cache.shape[1]
    cfg = config or decode_config(
        batch, num_kv_heads, block_tables.shape[1], page, head_dim, k_cache.dtype, device_sm_count(q.device)
    )
    out = torch.empty((batch, num_q_heads, head_dim), dtype=q.dtype, device=q.device)
    if batch == 0:
        return out
    splits = cfg.num_splits
    if splits > 1:
        part_o = torch.empty((batch, num_q_heads, splits, head_dim), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((batch, num_q_heads, splits), dtype=torch.float32, device=q.device)
    else:
        part_o = part_lse = out  # unused by the kernel when NUM_SPLITS == 1
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
        GROUP=group,
        HEAD_DIM=head_dim,
        PAGE=page,
        NUM_SPLITS=splits,
        BLOCK_G=max(16, triton.next_power_of_2(group)),
        BLOCK_N=cfg.block_n,
        BLOCK_D=block_d,
        PRECISION="ieee" if k_cache.dtype == torch.float32 else "tf32",
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    if splits > 1:
        _decode_reduce_kernel[(batch, num_q_heads)](
            part_o,
            part_lse,
            kv_seqlens,
            out,
            out.stride(0),
            out.stride(1),
            HEAD_DIM=head_dim,
            NUM_SPLITS=splits,
            BLOCK_N=cfg.block_n,
            BLOCK_S=triton.next_power_of_2(splits),
            BLOCK_D=block_d,
            num_warps=4 if splits * block_d >= 2048 else 2,
        )
    return out


__all__ = ["DecodeConfig", "decode_config", "decode_attention", "device_sm_count", "LOG2E"]
