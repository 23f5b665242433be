"""Torch reference operators for the paged KV cache (CPU and GPU).

Shapes (T = flat tokens, B = sequences, N = cache blocks, bs = block size):
  q: `[T, Hq, D]`, k/v: `[T, Hkv, D]`, caches: `[N, bs, Hkv, D]`.
These loop over sequences on the host: they are the correctness yardstick, not
the fast path, and are never captured in a CUDA graph.
"""
from __future__ import annotations

import torch


def store_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write row i of k/v to flat slot `slot_mapping[i]`; rows with slot < 0 or i >= len(slot_mapping) are skipped."""
    n = slot_mapping.shape[0]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    k_flat = k_cache.view(-1, *k_cache.shape[2:])
    v_flat = v_cache.view(-1, *v_cache.shape[2:])
    k_flat[slots] = k[:n][keep].to(k_cache.dtype)
    v_flat[slots] = v[:n][keep].to(v_cache.dtype)


def _gather_kv(cache: torch.Tensor, table: torch.Tensor, length: int) -> torch.Tensor:
    """Return the first `length` cached rows of one sequence as `[length, Hkv, D]`."""
    bs = cache.shape[1]
    nblk = -(-length // bs)
    return cache[table[:nblk].long()].reshape(nblk * bs, *cache.shape[2:])[:length]


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos0: int, scale: float) -> torch.Tensor:
    """Causal attention of `[n, Hq, D]` queries at positions q_pos0.. over `[L, Hkv, D]` keys, in fp32."""
    hq, hkv = q.shape[1], k.shape[1]
    group = hq // hkv
    qf = q.float().transpose(0, 1)  # [Hq, n, D]
    kf = k.float().repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, L, D]
    vf = v.float().repeat_interleave(group, dim=1).transpose(0, 1)
    scores = torch.matmul(qf, kf.transpose(1, 2)) * scale  # [Hq, n, L]
    q_pos = torch.arange(q.shape[0], device=q.device) + q_pos0
    k_pos = torch.arange(k.shape[0], device=q.device)
    scores = scores.masked_fill(k_pos[None, None, :] > q_pos[None, :, None], float("-inf"))
    out = torch.matmul(torch.softmax(scores, dim=-1), vf)  # [Hq, n, D]
    return out.transpose(0, 1).to(q.dtype)


def prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    q_start_loc: torch.Tensor,
    q_seqlens: torch.Tensor,
    kv_seqlens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    max_q_seqlen: int | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its cached history and themselves.

    KV for the new tokens must already be stored. Returns `[T, Hq, D]`; rows past
    the real tokens (bucket padding) are zero. `max_q_seqlen` (a grid hint for the
    kernels) is not needed here.
    """
    out = torch.zeros_like(q)
    starts, qlens, kvlens = q_start_loc.tolist(), q_seqlens.tolist(), kv_seqlens.tolist()
    for i, (s, n, L) in enumerate(zip(starts, qlens, kvlens)):
        k = _gather_kv(k_cache, block_tables[i], L)
        v = _gather_kv(v_cache, block_tables[i], L)
        out[s : s + n] = _attend(q[s : s + n], k, v, L - n, scale)
    return out


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    kv_seqlens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One query token per sequence (`q`: `[B, Hq, D]`) over its whole cached context."""
    out = torch.empty_like(q)
    for i, L in enumerate(kv_seqlens.tolist()):
        k = _gather_kv(k_cache, block_tables[i], L)
        v = _gather_kv(v_cache, block_tables[i], L)
        out[i : i + 1] = _attend(q[i : i + 1], k, v, L - 1, scale)
    return out
