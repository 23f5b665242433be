"""The paged attention operator: (q/k norm + rotary +) KV store + attention, one call per layer.

This is the request-dependent work of a decoder layer (it reads live block tables
and lengths, and writes the KV cache), so under piecewise CUDA graphs it is an
eager boundary with a padded raw-token output: it returns `[real_tokens, Hq, D]`
and the plan's bridge zeroes the bucket tail. In full decode graphs it is
captured whole (the Triton decode and store kernels have static grids).

With a `QKPrologue` the operator takes RAW (pre-norm) q/k and applies the per-head
RMSNorm + neox rotary itself, fused with the KV store into one kernel
(`KernelOps.qk_norm_rope_store`); under piecewise graphs that norm therefore runs
inside the eager boundary.
"""
from __future__ import annotations

from typing import Any, NamedTuple, Optional, Sequence

import torch

from graphrunner.piecewise import OutputPolicy, eager_boundary
from modeling.ops import KernelOps


class QKPrologue(NamedTuple):
    """What `paged_attention` needs to normalise and rotate raw q/k (`KernelOps.qk_norm_rope`'s arguments).

    q_weight, k_weight: per-head RMSNorm weights `[D]` (parameters); cos, sin: fp32 rotary tables
    `[max_pos, D]` (buffers); positions: int64 `[T]` of this step (>= the q/k rows); eps: the norm's epsilon.

    A NamedTuple (immutable) on purpose: a piecewise plan binds a boundary's tuple arguments item by item,
    so every tensor here becomes a non-owning view re-bound at each replay (positions: the plan's
    position_ids input; weights and tables: model storage) and eps a constant. A dataclass would be
    bound as one constant object pinning the start-up tensors.
    """

    q_weight: torch.Tensor
    k_weight: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    positions: torch.Tensor
    eps: float


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_caches: Sequence[Any],
    layer_idx: int,
    attn_metadata: Any,
    scale: float,
    ops: KernelOps,
    prologue: Optional[QKPrologue] = None,
) -> torch.Tensor:
    """q `[T, Hq, D]`, k/v `[T, Hkv, D]` with T >= attn_metadata.num_tokens (bucket padding past it).

    Without `prologue`, q/k are final (normalised, rotated) and the real tokens' K/V are stored
    (`ops.store_kv`). With it, q/k are RAW: `ops.qk_norm_rope_store` normalises and rotates q and k
    (all T rows of q) and stores the real tokens' K/V in the same kernel. Then the operator attends
    into `kv_caches[layer_idx]`, the kernel picked from live metadata: decode (one token per
    sequence) or prefill (causal over history + new tokens, also mixed batches).
    Returns `[attn_metadata.num_tokens, Hq, D]`.
    """
    n = attn_metadata.num_tokens
    k_cache, v_cache = kv_caches[layer_idx]
    if prologue is None:
        ops.store_kv(k, v, k_cache, v_cache, attn_metadata.slot_mapping)
    else:
        q = ops.qk_norm_rope_store(q, k, v, prologue.q_weight, prologue.k_weight, prologue.cos, prologue.sin,
                                   prologue.positions, prologue.eps, k_cache, v_cache, attn_metadata.slot_mapping)
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

    def __call__(self, q, k, v, kv_caches, layer_idx, attn_metadata, scale,
                 prologue: Optional[QKPrologue] = None) -> torch.Tensor:
        """prologue: None for final q/k (store only); a `QKPrologue` for raw q/k (norm + rope fused with the store)."""
        return self._fn(q, k, v, kv_caches, layer_idx, attn_metadata, scale, self.ops, prologue)
