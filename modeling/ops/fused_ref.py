"""Torch reference versions of the fused elementwise operators (CPU and GPU).

Numerics follow HF Qwen3: normalise in fp32, cast to the activation dtype, then scale by
the weight in that dtype. The Triton versions (`triton_fused.py`) have the same
signatures and fuse each function into one kernel.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from modeling.ops import attention_ref


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x `[..., H]`, weight `[H]` -> `[..., H]` in x's dtype."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual); x, residual `[T, H]`."""
    s = x + residual
    return rms_norm(s, weight, eps), s


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor, positions: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head RMSNorm of q `[T, Hq, D]` and k `[T, Hkv, D]`, then neox rotary at `positions` int64 `[T]`
    with fp32 tables cos/sin `[max_pos, D]`. Returns new tensors in q/k dtype."""
    q = rms_norm(q, q_weight, eps)
    k = rms_norm(k, k_weight, eps)
    c = cos[positions].unsqueeze(1).to(q.dtype)
    s = sin[positions].unsqueeze(1).to(q.dtype)
    return q * c + _rotate_half(q) * s, k * c + _rotate_half(k) * s


def qk_norm_rope_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_weight: torch.Tensor,
                       k_weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                       eps: float, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       slot_mapping: torch.Tensor) -> torch.Tensor:
    """`qk_norm_rope` of RAW q/k, then `attention_ref.store_kv` of the normalised k and of v at `slot_mapping`
    (rows with slot < 0 or i >= len(slot_mapping) are not stored). Returns the normalised, rotated q `[T, Hq, D]`."""
    q, k = qk_norm_rope(q, k, q_weight, k_weight, cos, sin, positions, eps)
    attention_ref.store_kv(k, v, k_cache, v_cache, slot_mapping)
    return q


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x `[T, 2I]` (gate then up) -> silu(gate) * up `[T, I]`."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
