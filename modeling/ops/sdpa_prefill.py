"""Long prefill sequences through torch's fused attention (cuDNN), the rest through the paged Triton kernel.

The paged prefill kernel (`triton_prefill`) runs at 270-360 TFLOP/s on an H100 at 2048-8192 tokens; cuDNN's
attention runs the same causal attention at 420-620 (`python -m bench.prefill_attn_tune`, docs/benchmarks.md,
twenty-third session). It needs contiguous K/V and host-known lengths, so it serves eager steps only (the
piecewise plans' attention boundary), never a captured graph: a step with a long sequence is kept out of the full
prefill graphs for it (`PrefillGraphBuffersMixin.supports_prefill_graph`).

`prefill_attention_by_sequence` keeps the signature of `prefill_attention` plus the step's host copies of the
lengths (`AttentionMetadata.host_lens`). Sequences whose causal prefill attends at least `min_pairs` (query, key)
pairs (`long_sequences`) go one by one:
1. their K/V pages are gathered (`index_select` over the block-table row) into contiguous `[Hkv, kv_len, D]`;
2. without history: one causal attention of the new tokens;
3. with history (a chunk of a long prompt): a non-causal attention over the history and a causal one over the new
   tokens, each with its log-sum-exp, merged in fp32 (the exact softmax over both parts);
4. the result is written into those sequences' rows of the output.
The other sequences (decode rows of a mixed step, short prompts) take the Triton kernel in one launch with the long
ones' query lengths set to 0 on the device (their programs exit at once). No host sync: the host lengths come with
the metadata, the device lengths are only masked.

Backends of one attention part (`attend`): "cudnn" (`aten._scaled_dot_product_cudnn_attention`), "flash"
(`aten._scaled_dot_product_flash_attention`), "math" (fp32 matmuls, the CPU tests' backend). Where a backend
rejects fewer K/V heads than query heads, K/V are repeated per group (remembered per process and group size).
bf16 and fp16 only; other dtypes, and any call under CUDA graph capture, take the Triton kernel for everything.
"""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import torch

# (query, key) pairs of a sequence's causal prefill from which it leaves the paged kernel: on an H100 the split's
# fixed cost (~100 us of gathers, copies and cuDNN's host work) lost at 2048 new tokens with no history (2.1M pairs)
# and broke even at 2048 after 6144 (14.7M); it won 1.26-1.43x from 8192 fresh tokens (33.6M) and 1.26-1.68x at
# 4096 after 12288-28672 (docs/benchmarks.md, twenty-third session).
SDPA_MIN_PAIRS = 24_000_000
BACKENDS = ("cudnn", "flash", "math")
_GQA_NATIVE: dict[tuple[str, int], bool] = {}  # (backend, group) -> takes fewer K/V heads; learnt at first use


def _attend_once(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
                 backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    if backend == "cudnn":
        out = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False, scale=scale)
    elif backend == "flash":
        out = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
    elif backend == "math":
        group = q.shape[1] // k.shape[1]
        kf = k.float().repeat_interleave(group, dim=1)
        vf = v.float().repeat_interleave(group, dim=1)
        s = q.float() @ kf.transpose(-1, -2) * scale
        if causal:
            lq, lk = s.shape[-2:]
            s = s.masked_fill(torch.ones(lq, lk, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
        lse = torch.logsumexp(s, dim=-1)
        return (torch.softmax(s, dim=-1) @ vf).to(q.dtype), lse
    else:
        raise ValueError(f"unknown attention backend {backend!r}; use one of {BACKENDS}")
    return out[0], out[1]


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
           backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    """q `[1, Hq, L, D]`, k/v `[1, Hkv, S, D]` (Hq a multiple of Hkv) -> (out `[1, Hq, L, D]` in q's dtype, fp32
    log-sum-exp (natural log) of each query's scaled scores, `[1, Hq, L]`). causal: query i sees keys 0..i (L == S)."""
    group = q.shape[1] // k.shape[1]
    key = (backend, group)
    if group > 1 and not _GQA_NATIVE.get(key, True):
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    try:
        out, lse = _attend_once(q, k, v, causal, scale, backend)
    except RuntimeError:
        if group == 1 or key in _GQA_NATIVE:
            raise
        _GQA_NATIVE[key] = False
        return attend(q, k, v, causal, scale, backend)
    if group > 1:
        _GQA_NATIVE.setdefault(key, True)
    return out, lse.reshape(q.shape[0], q.shape[1], q.shape[2]).float()


def merge(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor) -> torch.Tensor:
    """The attention over the union of two key sets from each part's output and log-sum-exp (`attend`'s)."""
    m = torch.maximum(lse_a, lse_b)
    wa = torch.exp(lse_a - m).unsqueeze(-1)
    wb = torch.exp(lse_b - m).unsqueeze(-1)
    return ((out_a.float() * wa + out_b.float() * wb) / (wa + wb)).to(out_a.dtype)


def sequence_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, table_row: torch.Tensor,
                       kv_len: int, scale: float, backend: str) -> torch.Tensor:
    """One sequence's causal prefill: q `[L, Hq, D]` (its new tokens, last dim contiguous), caches `[N, page, Hkv,
    D]` already holding its kv_len tokens (history then the L new ones) in the pages `table_row[:cdiv(kv_len,
    page)]` (int32, on the caches' device). Returns `[L, Hq, D]` in q's dtype (a new tensor)."""
    length = q.shape[0]
    hist = kv_len - length
    pages = table_row[: -(-kv_len // k_cache.shape[1])].long()
    k = k_cache.index_select(0, pages).flatten(0, 1)[:kv_len].transpose(0, 1).unsqueeze(0).contiguous()
    v = v_cache.index_select(0, pages).flatten(0, 1)[:kv_len].transpose(0, 1).unsqueeze(0).contiguous()
    qh = q.transpose(0, 1).unsqueeze(0).contiguous()
    if hist == 0:
        out = attend(qh, k, v, True, scale, backend)[0]
    else:
        out_h, lse_h = attend(qh, k[:, :, :hist], v[:, :, :hist], False, scale, backend)
        out_n, lse_n = attend(qh, k[:, :, hist:], v[:, :, hist:], True, scale, backend)
        out = merge(out_h, lse_h, out_n, lse_n)
    return out[0].transpose(0, 1)


def attended_pairs(q_lens, kv_lens):
    """(query, key) pairs of each sequence's causal prefill: q_len new tokens after kv_len - q_len cached ones
    (numpy or torch integer arrays; int64 arithmetic)."""
    q = q_lens.astype(np.int64) if isinstance(q_lens, np.ndarray) else q_lens.long()
    kv = kv_lens.astype(np.int64) if isinstance(kv_lens, np.ndarray) else kv_lens.long()
    return q * (kv - q) + q * (q + 1) // 2


def long_sequences(host: Sequence[np.ndarray], min_pairs: int = SDPA_MIN_PAIRS) -> np.ndarray:
    """Indices of the sequences `prefill_attention_by_sequence` sends through cuDNN; host = (q_start, q_seqlens,
    kv_seqlens) numpy `[B]`."""
    return np.flatnonzero(attended_pairs(host[1], host[2]) >= min_pairs)


def prefill_attention_by_sequence(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                  q_start_loc: torch.Tensor, q_seqlens: torch.Tensor, kv_seqlens: torch.Tensor,
                                  block_tables: torch.Tensor, scale: float, *, host: Sequence[np.ndarray],
                                  fallback: Callable[..., torch.Tensor], max_q_seqlen: int | None = None,
                                  backend: str = "cudnn", min_pairs: int = SDPA_MIN_PAIRS) -> torch.Tensor:
    """`prefill_attention` (same arguments and result: `[T, Hq, D]`, rows past the real tokens zero) with the
    `long_sequences` through `sequence_attention` and the others through `fallback`
    (the paged kernel, `prefill_attention`'s signature). `host`: (q_start_loc, q_seqlens, kv_seqlens) on the host,
    numpy int32 `[B]` equal to the device tensors (`AttentionMetadata.host_lens`). On the current stream; eager only (under capture everything takes `fallback`)."""
    host_start, q_lens, host_kv = host
    long = long_sequences(host, min_pairs)
    usable = k_cache.dtype in (torch.bfloat16, torch.float16) and not (
        q.is_cuda and torch.cuda.is_current_stream_capturing())
    if long.size == 0 or not usable:
        return fallback(q, k_cache, v_cache, q_start_loc, q_seqlens, kv_seqlens, block_tables, scale,
                        max_q_seqlen=max_q_seqlen)
    if long.size == q_lens.size:
        out = torch.zeros((q.shape[0], q.shape[1], q.shape[2]), dtype=q.dtype, device=q.device)
    else:
        short_lens = torch.where(attended_pairs(q_seqlens, kv_seqlens) >= min_pairs, 0, q_seqlens)
        short = np.ones(q_lens.size, dtype=bool)
        short[long] = False
        out = fallback(q, k_cache, v_cache, q_start_loc, short_lens.to(q_seqlens.dtype), kv_seqlens, block_tables,
                       scale, max_q_seqlen=int(q_lens[short].max()))
    for i in long.tolist():
        start, length = int(host_start[i]), int(q_lens[i])
        out[start:start + length] = sequence_attention(q[start:start + length], k_cache, v_cache, block_tables[i],
                                                       int(host_kv[i]), scale, backend)
    return out


__all__ = ["BACKENDS", "SDPA_MIN_PAIRS", "attend", "attended_pairs", "long_sequences", "merge",
           "prefill_attention_by_sequence", "sequence_attention"]
