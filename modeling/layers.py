"""Dense building blocks of Qwen3: RMSNorm, rotary embedding, attention, SiLU-gated MLP.

Activations are flattened tokens `[T, ...]` in the model dtype. Nothing here syncs
with the host, so every layer can be captured in a CUDA graph; the only
request-dependent work (KV store + attention) goes through `modeling.attention`.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from modeling.attention import AttentionImpl, QKPrologue
from modeling.config import ModelConfig
from modeling.ops import KernelOps
from modeling.rope import RopeScaling, rope_tables
from parallel import comm
from parallel.context import ParallelContext
from parallel.layers import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear


class RMSNorm(nn.Module):
    """y = w * x / rms(x) (HF Qwen3 numerics), optionally fused with the residual add."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype, ops: KernelOps, device=None):
        super().__init__()
        self.eps = eps
        self.ops = ops
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
        """Without residual: norm(x). With residual `[T, H]`: (norm(x + residual), x + residual)."""
        if residual is None:
            return self.ops.rms_norm(x, self.weight, self.eps)
        return self.ops.add_rms_norm(x, residual, self.weight, self.eps)


class RotaryEmbedding(nn.Module):
    """Neox-style (rotate-half) rotary tables: fp32 cos/sin `[max_pos, D]` (applied by `KernelOps.qk_norm_rope_store`),
    with `scaling` (linear or YaRN, `modeling.rope`) folded in: YaRN's attention factor multiplies both tables."""

    def __init__(self, head_dim: int, max_position: int, theta: float, device=None, scaling: RopeScaling | None = None):
        super().__init__()
        cos, sin = rope_tables(head_dim, max_position, theta, scaling, device)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)


class Qwen3Attention(nn.Module):
    """GQA self-attention with per-head q/k RMSNorm, heads split over the TP group."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, ctx: ParallelContext, attn: AttentionImpl, rope: RotaryEmbedding,
                 ops: KernelOps, device=None):
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = cfg.head_dim
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, ctx, cfg.dtype, device)
        self.num_heads = self.qkv_proj.num_heads_local
        self.num_kv_heads = self.qkv_proj.num_kv_heads_local
        self.o_proj = RowParallelLinear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, ctx, cfg.dtype, device)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, cfg.dtype, ops, device)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, cfg.dtype, ops, device)
        self.rope = rope
        self.ops = ops
        self.attn = attn
        self.scale = cfg.head_dim ** -0.5

    def forward(self, positions: torch.Tensor, x: torch.Tensor, kv_caches: Sequence[Any], attn_metadata: Any) -> torch.Tensor:
        return self.o_proj(self.attend(positions, x, kv_caches, attn_metadata))

    def attend(self, positions: torch.Tensor, x: torch.Tensor, kv_caches: Sequence[Any], attn_metadata: Any) -> torch.Tensor:
        """Everything before the output projection: x `[T, H]` -> attention output `[T, Hq_local * D]`."""
        return self.attend_projected(positions, self.qkv_proj(x), kv_caches, attn_metadata)

    def attend_projected(self, positions: torch.Tensor, qkv: torch.Tensor, kv_caches: Sequence[Any],
                         attn_metadata: Any) -> torch.Tensor:
        """`attend` after the qkv projection: qkv `[T, (Hq_local + 2 * Hkv_local) * D]` -> `[T, Hq_local * D]`."""
        t = qkv.shape[0]
        q, k, v = qkv.split(self.qkv_proj.local_sizes, dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        # q/k go in RAW: the operator applies the per-head norm + rotary fused with the KV store (one kernel).
        prologue = QKPrologue(self.q_norm.weight, self.k_norm.weight, self.rope.cos, self.rope.sin, positions,
                              self.q_norm.eps)
        o = self.attn(q, k, v, kv_caches, self.layer_idx, attn_metadata, self.scale, prologue)
        if o.shape[0] < t:  # bucket-shaped eager: rows past the real tokens are zero, as a plan's padded bridge makes them
            o = F.pad(o, (0, 0, 0, 0, 0, t - o.shape[0]))
        return o.reshape(t, self.num_heads * self.head_dim)


def project_add_norm(proj: RowParallelLinear, x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm, ops: KernelOps,
                     gated: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(y + residual), y + residual) for y = proj(x) (gated: proj(silu_and_mul(x))), x `[T, in]`, residual
    `[T, H]`. Without TP the projection, the residual add and the norm are one operator (`linear_add_rms_norm`,
    one kernel on the decode path); under TP the all-reduce, the add and the norm are one operator
    (`comm.all_reduce_add_rms_norm`: one kernel over symmetric memory when the group has it) after the GEMM."""
    if proj.ctx.tp_size == 1:
        return ops.linear_add_rms_norm(x, proj.weight, residual, norm.weight, norm.eps, gated=gated)
    y = proj.forward_with(ops.silu_mul_linear if gated else proj.gemm, x, reduce=False)
    if not proj.reduce_results:
        return norm(y, residual)
    return comm.all_reduce_add_rms_norm(y, residual, norm.weight, norm.eps, proj.ctx.tp_group, norm)


class Qwen3MLP(nn.Module):
    """down(silu(gate(x)) * up(x)) with gate/up fused and the intermediate dim split over TP."""

    def __init__(self, hidden: int, intermediate: int, ctx: ParallelContext, dtype: torch.dtype, ops: KernelOps, device=None):
        super().__init__()
        self.ops = ops
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [intermediate, intermediate], ctx, dtype, device)
        self.down_proj = RowParallelLinear(intermediate, hidden, ctx, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj.forward_with(self.ops.silu_mul_linear, self.gate_up_proj(x))
