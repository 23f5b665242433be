"""Torch references of the MoE expert computation (CPU and GPU), the yardstick of `triton_moe`.

Shapes: x `[N, H]`; ids int64 `[N, k]` global expert ids (-1 = no expert); weights fp32 `[N, k]`; this rank's
experts `first_expert .. first_expert + E_local`: w13 `[E_local, 2I, H]` (gate rows then up rows), w2
`[E_local, H, I]`, all in x's dtype. Pairs routed to other experts contribute zero. Rounding, as the
routed kernel: each projection rounded to the dtype, silu(gate) rounded, times up rounded; the weighted sum
over a token's experts in fp32, rounded once.

- `experts_static`: every local expert on every token (two batched GEMMs, a dense routing matrix): no host
  sync, fixed shapes; work grows with E_local, so it serves small batches and CPU.
- `experts_grouped`: one GEMM pair per expert with tokens; reads the counts on the host (eager only).
- `group_by_expert`: the grouping `triton_moe.group_by_expert` computes (a stable sort of pairs by expert).
- `packed_experts`: DeepEP's packed layout `[E_local, cap, H]` with per-expert counts.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def _local(ids: torch.Tensor, e_local: int, first_expert: int) -> tuple[torch.Tensor, torch.Tensor]:
    local = ids - first_expert
    return local, (ids >= 0) & (local >= 0) & (local < e_local)


def experts_static(x, ids, weights, w13, w2, first_expert: int) -> torch.Tensor:
    n, e_local = x.shape[0], w13.shape[0]
    local, valid = _local(ids, e_local, first_expert)
    dense = torch.zeros(n, e_local, dtype=torch.float32, device=x.device)
    dense.scatter_add_(1, local.clamp(0, e_local - 1), torch.where(valid, weights, torch.zeros_like(weights)))
    h = torch.matmul(x.unsqueeze(0), w13.transpose(1, 2))  # [E, N, 2I]
    gate, up = h.chunk(2, dim=-1)
    y = torch.matmul(F.silu(gate) * up, w2.transpose(1, 2))  # [E, N, H]
    return torch.einsum("enh,ne->nh", y.float(), dense).to(x.dtype)


def experts_grouped(x, ids, weights, w13, w2, first_expert: int) -> torch.Tensor:
    n, k = ids.shape
    e_local = w13.shape[0]
    out = torch.zeros(n, x.shape[1], dtype=torch.float32, device=x.device)
    sorted_pairs, counts = group_by_expert(ids, e_local, first_expert)
    sorted_pairs = sorted_pairs.long()
    start = 0
    for e, c in enumerate(counts.tolist()):  # host read: eager only
        if c == 0:
            continue
        sel = sorted_pairs[start : start + c]
        tok = sel // k
        gate, up = F.linear(x[tok], w13[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w2[e])
        out.index_add_(0, tok, y.float() * weights.flatten()[sel].unsqueeze(-1))
        start += c
    return out.to(x.dtype)


def group_by_expert(ids: torch.Tensor, e_local: int, first_expert: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ids `[N, k]` -> (sorted_pairs int32 `[N * k]`: the flat pair indices of local experts grouped by expert in
    pair order, then the others; counts int32 `[e_local]`)."""
    local, valid = _local(ids.flatten(), e_local, first_expert)
    key = torch.where(valid, local, torch.full_like(local, e_local))
    order = torch.argsort(key, stable=True)
    counts = torch.zeros(e_local + 1, dtype=torch.int64, device=ids.device)
    counts.scatter_add_(0, key, torch.ones_like(key))
    return order.to(torch.int32), counts[:e_local].to(torch.int32)


def packed_experts(x: torch.Tensor, counts: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """x `[E_local, cap, H]`, counts `[E_local]` -> `[E_local, cap, H]`: expert e on x[e, :counts[e]], zero rows
    past the count."""
    h = torch.matmul(x, w13.transpose(1, 2))  # [E, cap, 2I]
    gate, up = h.chunk(2, dim=-1)
    y = torch.matmul(F.silu(gate) * up, w2.transpose(1, 2))
    rows = torch.arange(x.shape[1], device=x.device)[None, :] < counts.to(x.device)[:, None]
    return torch.where(rows[..., None], y, torch.zeros_like(y))
