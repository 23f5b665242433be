"""Qwen3-MoE sparse block: softmax top-k router (optionally renormalised) and SiLU experts.

Expert weights: w13 `[E_local, 2 * I_local, H]` (gate rows then up rows), w2 `[E_local, H, I_local]`.
With expert parallelism (ep > 1) experts are split by index over the EP group and a
token dispatcher from `parallel` moves tokens; otherwise the intermediate dim is split
over TP and the output summed over the TP group.

Two expert kernels, chosen by the (static) number of tokens, never by data:
- static (tokens <= `static_max_tokens`): every local expert on every token through
  two batched GEMMs, weighted by a dense `[N, E_local]` routing matrix. Fixed shapes,
  no host sync: this is what decode CUDA graphs capture.
- grouped (more tokens): tokens sorted by expert, one GEMM pair per expert that has
  tokens (reads expert counts on the host). Used eagerly, inside the MoE eager
  boundary of piecewise prefill plans.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from graphrunner.piecewise import eager_boundary
from modeling.config import ModelConfig
from parallel import comm
from parallel.context import ParallelContext
from parallel.layers import WeightShapeError


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits `[N, E]` -> (weights fp32 `[N, k]`, expert ids int64 `[N, k]`)."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def _experts_static(x, ids, weights, w13, w2, first_expert: int) -> torch.Tensor:
    n, e_local = x.shape[0], w13.shape[0]
    local = ids - first_expert
    valid = (local >= 0) & (local < e_local)
    dense = torch.zeros(n, e_local, dtype=torch.float32, device=x.device)
    dense.scatter_add_(1, local.clamp(0, e_local - 1), torch.where(valid, weights, torch.zeros_like(weights)))
    h = torch.matmul(x.unsqueeze(0), w13.transpose(1, 2))  # [E, N, 2I]
    gate, up = h.chunk(2, dim=-1)
    y = torch.matmul(F.silu(gate) * up, w2.transpose(1, 2))  # [E, N, H]
    return torch.einsum("enh,ne->nh", y.float(), dense).to(x.dtype)


def _experts_grouped(x, ids, weights, w13, w2, first_expert: int) -> torch.Tensor:
    n, k = ids.shape
    e_local = w13.shape[0]
    out = torch.zeros(n, x.shape[1], dtype=torch.float32, device=x.device)
    flat = ids.flatten() - first_expert
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat.clamp(-1, e_local).add(1), minlength=e_local + 2)[1 : e_local + 1].tolist()
    start = int((flat < 0).sum().item())
    token_of = order // k
    for e, c in enumerate(counts):
        if c == 0:
            continue
        sel = order[start : start + c]
        tok = token_of[start : start + c]
        gate, up = F.linear(x[tok], w13[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w2[e])
        out.index_add_(0, tok, y.float() * weights.flatten()[sel].unsqueeze(-1))
        start += c
    return out.to(x.dtype)


class SparseMoeBlock(nn.Module):
    """hidden `[T, H]` -> `[T, H]`. The router runs captured; routing + expert dispatch is an eager
    boundary under piecewise graphs (`moe_boundary`), because the grouped path reads counts on the host."""

    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, device=None, static_max_tokens: int = 256):
        super().__init__()
        self.ctx = ctx
        self.top_k = cfg.num_experts_per_tok
        self.renormalize = cfg.norm_topk_prob
        self.num_experts = cfg.num_experts
        self.hidden = cfg.hidden_size
        self.static_max_tokens = static_max_tokens
        self.ep = ctx.ep_size > 1
        if self.ep:
            if cfg.num_experts % ctx.ep_size:
                raise ValueError(f"num_experts={cfg.num_experts} is not divisible by ep size {ctx.ep_size}")
            self.e_local = cfg.num_experts // ctx.ep_size
            self.first_expert = ctx.ep_rank * self.e_local
            self.i_local = cfg.moe_intermediate_size
        else:
            if cfg.moe_intermediate_size % ctx.tp_size:
                raise ValueError(f"moe_intermediate_size={cfg.moe_intermediate_size} not divisible by tp {ctx.tp_size}")
            self.e_local, self.first_expert = cfg.num_experts, 0
            self.i_local = cfg.moe_intermediate_size // ctx.tp_size
        self.i_full = cfg.moe_intermediate_size
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False, dtype=cfg.dtype, device=device)
        self.gate.weight.requires_grad_(False)
        self.w13 = nn.Parameter(torch.empty(self.e_local, 2 * self.i_local, self.hidden, dtype=cfg.dtype, device=device),
                                requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(self.e_local, self.hidden, self.i_local, dtype=cfg.dtype, device=device),
                               requires_grad=False)
        self._experts = self.experts
        self.dispatcher = ctx.ep_dispatcher

    # ---- weight loading: HF per-expert tensors (gate/up/down) or fused [E, ...] tensors
    def load_expert(self, expert: int, which: str, full: torch.Tensor) -> bool:
        """Copy one HF expert tensor `[I, H]` (gate/up) or `[H, I]` (down), possibly lazy; returns False, having read
        nothing but its shape, when the expert lives on another EP rank."""
        want = (self.hidden, self.i_full) if which == "down" else (self.i_full, self.hidden)
        if tuple(full.shape) != want:
            raise WeightShapeError(f"expert {expert} {which}_proj: shape {tuple(full.shape)} != expected {want}")
        e = expert - self.first_expert
        if not 0 <= e < self.e_local:
            return False
        r = 0 if self.ep else self.ctx.tp_rank
        sl = slice(r * self.i_local, (r + 1) * self.i_local)
        if which == "gate":
            self.w13.data[e, : self.i_local].copy_(full[sl])
        elif which == "up":
            self.w13.data[e, self.i_local :].copy_(full[sl])
        else:
            self.w2.data[e].copy_(full[:, sl])
        return True

    def supports_piecewise_cuda_graph(self) -> bool:
        return True

    def enable_piecewise_cuda_graph(self) -> None:
        self._experts = functools.partial(_moe_boundary, self)

    def experts(self, hidden: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """Route, dispatch (EP), run the local experts, combine. `[T, H]`, `[T, E]` -> `[T, H]`."""
        weights, ids = route(router_logits, self.top_k, self.renormalize)
        handle = None
        if self.dispatcher is not None:
            hidden, ids, weights, handle = self.dispatcher.dispatch(hidden, ids, weights)
        fn = _experts_static if hidden.shape[0] <= self.static_max_tokens else _experts_grouped
        out = fn(hidden, ids, weights, self.w13, self.w2, self.first_expert)
        if self.dispatcher is not None:
            return self.dispatcher.combine(out, handle)
        return comm.all_reduce(out, self.ctx.tp_group) if self.ctx.tp_size > 1 else out

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._experts(hidden, self.gate(hidden))


# The output feeds only the next captured piece (residual add + norm), so its bridge storage is recycled after it.
_moe_boundary = eager_boundary(reuse_bridge_after_next_step=True)(SparseMoeBlock.experts)
