"""MoE router in one launch: fp32 softmax over the experts, top-k, optional renormalisation (`modeling.moe.route`).

Shapes and dtypes: router_logits `[N, E]` bf16, fp16 or fp32, E <= 512, any row stride (a last stride other than 1
is copied first) -> (weights fp32 `[N, k]`, ids int64 `[N, k]`), k <= E. Numerics follow `route`: the softmax in
fp32 (max-subtract, exp, sum, divide), the k largest probabilities descending, ties to the lower expert id,
renormalised by the sum of the k chosen probabilities. The fp32 sums are ordered differently from torch's, and
`tl.exp` is the GPU's approximate exp2-based one: weights agree to a few ulps.

The top-k runs on int64 keys, probability bits (non-negative fp32 bits order as integers) in the high 32 bits and
(E_PAD - 1 - id) in the low bits, so a larger key is a larger probability, then a lower id: Triton's bitonic
`tl.topk` where this Triton has it (3.3 on), else k extractions of the max. Padded lanes (E..E_PAD) get key -1.

Grid `(cdiv(N, R),)` with R rows a program (`rows_per_program`: 1024 logits a program at most, so 8 rows of 128
experts, 1 row at N = 1); static, no host sync, no process-wide state: capturable in a CUDA graph. Launched
on the current stream with PDL mode `pdl` (`modeling.ops.pdl`). Lifetime: outputs are new tensors from the caching
allocator (graph-pool memory under capture). N == 0 launches nothing.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from modeling.ops.pdl import PDL_LAUNCH, pdl_launch_dependents, pdl_wait

MAX_EXPERTS = 512
_TILE = 1024  # logits a program holds at most
BITONIC = tl.constexpr(hasattr(tl, "topk"))


@triton.jit
def _largest_keys(keys, K_PAD: tl.constexpr):
    """Per row, the K_PAD (a power of two) largest of the unique int64 keys `[R, E_PAD]`, descending: `[R, K_PAD]`."""
    if BITONIC:
        out = tl.topk(keys, K_PAD)
    else:
        j = tl.arange(0, K_PAD)[None, :]
        out = tl.full([keys.shape[0], K_PAD], -1, tl.int64)
        for n in range(K_PAD):
            t = tl.max(keys, axis=1)[:, None]
            keys = tl.where(keys == t, -1, keys)
            out = tl.where(j == n, t, out)
    return out


@triton.jit(do_not_specialize=["N"])
def _route_kernel(L, W, I, N, E, stride_l, K: tl.constexpr, R: tl.constexpr, E_PAD: tl.constexpr,
                  K_PAD: tl.constexpr, RENORM: tl.constexpr, PDL: tl.constexpr):
    """Rows [R * program_id, + R) of L `[N, E]` -> W `[N, K]` fp32 probabilities, I `[N, K]` int64 ids (contiguous).
    Rows past N recompute row N - 1 and store nothing."""
    pdl_launch_dependents(PDL)
    rows = tl.program_id(0).to(tl.int64) * R + tl.arange(0, R)
    live = rows < N
    offs = tl.arange(0, E_PAD)
    valid = offs < E
    pdl_wait(PDL)
    src = tl.minimum(rows, N - 1)[:, None] * stride_l + offs[None, :]
    x = tl.load(L + src, mask=valid[None, :], other=float("-inf")).to(tl.float32)
    e = tl.exp(x - tl.max(x, axis=1)[:, None])
    p = e / tl.sum(e, axis=1)[:, None]
    bits = p.to(tl.int32, bitcast=True).to(tl.int64)
    keys = tl.where(valid[None, :], (bits << 32) | (E_PAD - 1 - offs).to(tl.int64)[None, :], -1)
    top = _largest_keys(keys, K_PAD)
    ids = (E_PAD - 1) - (top & 0xFFFFFFFF)
    w = (top >> 32).to(tl.int32).to(tl.float32, bitcast=True)
    j = tl.arange(0, K_PAD)[None, :]
    keep = j < K
    if RENORM:
        w = w / tl.sum(tl.where(keep, w, 0.0), axis=1)[:, None]
    dst = rows[:, None] * K + j
    tl.store(W + dst, w, mask=live[:, None] & keep)
    tl.store(I + dst, ids, mask=live[:, None] & keep)


def rows_per_program(n: int, e_pad: int) -> int:
    """Rows a program routes: up to 1024 logits a program (8 rows of 128 experts), never more rows than N."""
    return min(triton.next_power_of_2(n), max(1, _TILE // e_pad))


def route_topk(router_logits: torch.Tensor, top_k: int, renormalize: bool, *,
               pdl: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits `[N, E]` -> (weights fp32 `[N, k]`, expert ids int64 `[N, k]`) in one launch, as `route`."""
    n, e = router_logits.shape
    if not 1 <= top_k <= e or e > MAX_EXPERTS:
        raise ValueError(f"route_topk: top_k={top_k} must be in [1, E={e}] and E <= {MAX_EXPERTS}")
    if router_logits.stride(1) != 1:
        router_logits = router_logits.contiguous()
    weights = torch.empty((n, top_k), dtype=torch.float32, device=router_logits.device)
    ids = torch.empty((n, top_k), dtype=torch.int64, device=router_logits.device)
    if n == 0:
        return weights, ids
    e_pad = triton.next_power_of_2(e)
    rows = rows_per_program(n, e_pad)
    _route_kernel[(triton.cdiv(n, rows),)](
        router_logits, weights, ids, n, e, router_logits.stride(0), K=top_k, R=rows, E_PAD=e_pad,
        K_PAD=triton.next_power_of_2(top_k), RENORM=bool(renormalize), num_warps=max(1, min(4, rows * e_pad // 256)),
        **PDL_LAUNCH[pdl])
    return weights, ids
