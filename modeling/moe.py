"""Qwen3-MoE sparse block: softmax top-k router (optionally renormalised) and SiLU experts.

Expert weights: w13 `[E_local, 2 * I_local, H]` (gate rows then up rows), w2 `[E_local, H, I_local]`.
With expert parallelism (ep > 1) experts are split by index over the EP group and a
token dispatcher from `parallel` moves tokens; otherwise the intermediate dim is split
over TP and the output summed over the TP group.

Expert paths (`expert_path`, a pure function of the row count, the backend and whether a CUDA
capture is in progress; never of routing data):
- routed (the Triton backend, every size: decode buckets, EP-gathered rows, prefill): each
  token pair runs only its expert (`modeling.ops.triton_moe`: device-side grouping, grouped
  GEMMs), no host sync, one launch shape per row count: what decode graphs capture. DeepEP's
  packed low-latency layout goes to its packed variant.
- static (torch backend, rows <= `static_max_tokens` or inside a capture): every local expert on
  every token through two batched GEMMs (`moe_ref.experts_static`); no host sync.
- grouped (torch backend, more rows, eager only): one GEMM pair per expert with tokens; reads the
  counts on the host (`moe_ref.experts_grouped`), so no captured step may take it.
"""
from __future__ import annotations

import functools

import torch
from torch import nn

from graphrunner.piecewise import eager_boundary
from modeling.config import ModelConfig
from modeling.ops import KernelOps, moe_ref
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


_experts_static = moe_ref.experts_static  # the names the dispatcher tests import
_experts_grouped = moe_ref.experts_grouped
EXPERT_PATHS = ("routed", "static", "grouped")
HOST_SYNC_PATHS = frozenset({"grouped"})


def expert_path(rows: int, *, routed: bool, capturing: bool, static_max_tokens: int) -> str:
    """The expert kernel for `rows` dispatched rows: "routed" whenever the backend has the routed kernel,
    else "static" inside a capture or up to `static_max_tokens` rows, else "grouped" (host sync: eager only)."""
    if routed:
        return "routed"
    if capturing or rows <= static_max_tokens:
        return "static"
    return "grouped"


def capture_active(t: torch.Tensor) -> bool:
    """Whether a CUDA stream capture is recording on t's device now (False on CPU)."""
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


class SparseMoeBlock(nn.Module):
    """hidden `[T, H]` -> `[T, H]`. The router runs captured. Under piecewise graphs, routing + expert dispatch
    is an eager boundary (`_moe_boundary`, `needs_eager_boundary`) where counts reach the host: the EP dispatchers
    exchange them in prefill, and the torch backend's grouped path reads them. Otherwise, with
    `KernelOptions.moe_in_pieces` (the default), the routed kernel is captured inside the pieces. `ops`: the backend
    whose routed-expert kernels (`KernelOps.moe_routed` / `moe_packed`) and one-launch router (`KernelOps.moe_route`)
    serve when it has them (None: the torch paths)."""

    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, device=None, static_max_tokens: int = 256,
                 ops: KernelOps | None = None):
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
        self.routed_kernel = ops.moe_routed if ops is not None else None
        self.packed_kernel = ops.moe_packed if ops is not None else None
        self.route_kernel = ops.moe_route if ops is not None else None
        self.router_linear = (ops.moe_router_linear if ops is not None else None) or torch.nn.functional.linear
        self.in_pieces = ops is not None and ops.options.moe_in_pieces

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

    def needs_eager_boundary(self) -> bool:
        """Whether routing + experts run eagerly between graph pieces. They must where counts reach the host: an
        EP dispatcher exchanges them, and the torch backend's grouped path reads them. The routed kernel alone
        syncs with nothing and has one launch shape per row count, so without a dispatcher it can be captured
        inside the pieces where the options the backend was bound with say so (`KernelOptions.moe_in_pieces`, on by
        default)."""
        return self.dispatcher is not None or self.routed_kernel is None or not self.in_pieces

    def enable_piecewise_cuda_graph(self) -> None:
        if self.needs_eager_boundary():
            self._experts = functools.partial(_moe_boundary, self)

    def experts(self, hidden: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """Route, dispatch (EP), run the local experts, combine. `[T, H]`, `[T, E]` -> `[T, H]`."""
        if self.route_kernel is not None:
            weights, ids = self.route_kernel(router_logits, self.top_k, self.renormalize)
        else:
            weights, ids = route(router_logits, self.top_k, self.renormalize)
        handle = None
        if self.dispatcher is not None:
            hidden, ids, weights, handle = self.dispatcher.dispatch(hidden, ids, weights)
        out = self.local_experts(hidden, ids, weights, handle)
        if self.dispatcher is not None:
            return self.dispatcher.combine(out, handle)
        return comm.all_reduce(out, self.ctx.tp_group) if self.ctx.tp_size > 1 else out

    def local_experts(self, hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                      handle=None) -> torch.Tensor:
        """This rank's experts on dispatched rows: hidden `[N, H]`, ids int64 `[N, k]` (global, -1 = none), weights
        fp32 `[N, k]` -> `[N, H]` (not yet combined over ranks). A packed dispatch (`packed_counts` of the
        handle: DeepEP low latency) goes to the packed kernel where the backend has one."""
        counts = self.dispatcher.packed_counts(handle) if self.dispatcher is not None else None
        if counts is not None and self.packed_kernel is not None:
            x = hidden.view(self.e_local, -1, hidden.shape[-1])
            return self.packed_kernel(x, counts, self.w13, self.w2).view(hidden.shape)
        path = expert_path(hidden.shape[0], routed=self.routed_kernel is not None, capturing=capture_active(hidden),
                           static_max_tokens=self.static_max_tokens)
        if path == "routed":
            return self.routed_kernel(hidden, ids, weights, self.w13, self.w2, self.first_expert)
        fn = _experts_static if path == "static" else _experts_grouped
        return fn(hidden, ids, weights, self.w13, self.w2, self.first_expert)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._experts(hidden, self.router_linear(hidden, self.gate.weight))

    def forward_routed(self, hidden: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """`forward` with the router logits `[T, E]` already computed from hidden `[T, H]` (by a projection that
        carried the norm before it: `KernelOps.norm_linear_normed`)."""
        return self._experts(hidden, router_logits)


# The output feeds only the next captured piece (residual add + norm), so its bridge storage is recycled after it.
_moe_boundary = eager_boundary(reuse_bridge_after_next_step=True)(SparseMoeBlock.experts)
