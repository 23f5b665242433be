"""The paged attention operator: KV store + attention, one call per layer.

This is the request-dependent work of a decoder layer (it reads live block tables
and lengths, and writes the KV cache), so under piecewise CUDA graphs it is an
eager boundary with a padded raw-token output: it returns `[real_tokens, Hq, D]`
and the plan's bridge zeroes the bucket tail. In full decode graphs it is
captured whole (the Triton decode and store kernels have static grids).
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from graphrunner.piecewise import OutputPolicy, eager_boundary
from modeling.ops import KernelOps


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_caches: Sequence[Any],
    layer_idx: int,
    attn_metadata: Any,
    scale: float,
    ops: KernelOps,
) -> torch.Tensor:
    """q `[T, Hq, D]`, k/v `[T, Hkv, D]` with T >= attn_metadata.num_tokens (bucket padding past it).

    Stores the real tokens' K/V into `kv_caches[layer_idx]`, then attends. The
    kernel is picked from live metadata: decode (one token per sequence) or
    prefill (causal over history + new tokens, also mixed batches).
    Returns `[attn_metadata.num_tokens, Hq, D]`.
    """
    n = attn_metadata.num_tokens
    k_cache, v_cache = kv_caches[layer_idx]
    ops.store_kv(k, v, k_cache, v_cache, attn_metadata.slot_mapping)
    q = q[:n]
    if attn_metadata.is_decoding:
        return ops.decode_attention(q, k_cache, v_cache, attn_metadata.block_tables, attn_metadata.kv_seqlens, scale)
    return ops.prefill_attention(
        q, k_cache, v_cache, attn_metadata.q_start_loc, attn_metadata.q_seqlens, attn_metadata.kv_seqlens,
        attn_metadata.block_tables, scale, max_q_seqlen=attn_metadata.max_q_seqlen,
    )


# The output feeds only the next captured piece (o_proj), so its bridge storage is recycled after it.
_paged_attention_boundary = eager_boundary(output=OutputPolicy.PADDED_TOKENS, token_axis=0,
                                           reuse_bridge_after_next_step=True)(paged_attention)


class AttentionImpl:
    """Per-model attention operator holder (shared by all layers). Not an nn.Module: no weights."""

    def __init__(self, ops: KernelOps):
        self.ops = ops
        self._fn = paged_attention

    def supports_piecewise_cuda_graph(self) -> bool:
        return True

    def enable_piecewise_cuda_graph(self) -> None:
        self._fn = _paged_attention_boundary

    def __call__(self, q, k, v, kv_caches, layer_idx, attn_metadata, scale) -> torch.Tensor:
        return self._fn(q, k, v, kv_caches, layer_idx, attn_metadata, scale, self.ops)
