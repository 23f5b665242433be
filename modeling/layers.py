"""Dense building blocks of Qwen3: RMSNorm, rotary embedding, attention, SiLU-gated MLP.

Activations are flattened tokens `[T, ...]` in the model dtype. Nothing here syncs
with the host, so every layer can be captured in a CUDA graph; the only
request-dependent work (KV store + attention) goes through `modeling.attention`.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from modeling.attention import AttentionImpl
from modeling.config import ModelConfig
from parallel.context import ParallelContext
from parallel.layers import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear


class RMSNorm(nn.Module):
    """y = w * x / rms(x), computed in fp32 and cast back (HF Qwen3 numerics)."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)


class RotaryEmbedding(nn.Module):
    """Neox-style (rotate-half) rotary embedding with a precomputed fp32 cos/sin table `[max_pos, D]`."""

    def __init__(self, head_dim: int, max_position: int, theta: float, device=None):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim))
        t = torch.arange(max_position, dtype=torch.float32, device=device)
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    @staticmethod
    def _rotate_half(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions int64 `[T]`; q `[T, Hq, D]`, k `[T, Hkv, D]`."""
        cos = self.cos[positions].unsqueeze(1).to(q.dtype)
        sin = self.sin[positions].unsqueeze(1).to(q.dtype)
        return q * cos + self._rotate_half(q) * sin, k * cos + self._rotate_half(k) * sin


class Qwen3Attention(nn.Module):
    """GQA self-attention with per-head q/k RMSNorm, heads split over the TP group."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, ctx: ParallelContext, attn: AttentionImpl, rope: RotaryEmbedding,
                 device=None):
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = cfg.head_dim
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, ctx, cfg.dtype, device)
        self.num_heads = self.qkv_proj.num_heads_local
        self.num_kv_heads = self.qkv_proj.num_kv_heads_local
        self.o_proj = RowParallelLinear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, ctx, cfg.dtype, device)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, cfg.dtype, device)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, cfg.dtype, device)
        self.rope = rope
        self.attn = attn
        self.scale = cfg.head_dim ** -0.5

    def forward(self, positions: torch.Tensor, x: torch.Tensor, kv_caches: Sequence[Any], attn_metadata: Any) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.qkv_proj.local_sizes, dim=-1)
        q = self.q_norm(q.reshape(t, self.num_heads, self.head_dim))
        k = self.k_norm(k.reshape(t, self.num_kv_heads, self.head_dim))
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        q, k = self.rope(positions, q, k)
        o = self.attn(q, k, v, kv_caches, self.layer_idx, attn_metadata, self.scale)
        return self.o_proj(o.reshape(t, self.num_heads * self.head_dim))


class Qwen3MLP(nn.Module):
    """down(silu(gate(x)) * up(x)) with gate/up fused and the intermediate dim split over TP."""

    def __init__(self, hidden: int, intermediate: int, ctx: ParallelContext, dtype: torch.dtype, device=None):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [intermediate, intermediate], ctx, dtype, device)
        self.down_proj = RowParallelLinear(intermediate, hidden, ctx, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)
