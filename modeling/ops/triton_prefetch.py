"""Pull the weights a decode layer reads next into L2 while its attention runs (`l2_prefetch`).

At a few decode rows a layer is a chain of weight-streaming projections with latency-bound kernels between them:
the split-KV attention of a short context reads a few MB in several microseconds, and memory sits idle while it
runs. `l2_prefetch` is one small kernel, launched between the qkv projection and the attention, whose programs
issue `prefetch.global.L2::evict_last` for the first `max_bytes` of the next weights in the order the layer reads
them (the output projection, then the MLP's), so the projections after the attention find part of their weights
in L2. Nothing is computed or written: the results of the step are those of the step without it.

PDL (`modeling.ops.pdl`): the weights are written by no kernel of the step, so the prefetches are issued before
the wait (rule 2); every program then waits (rule 3), so the kernel after it still sees everything before it
complete. With PDL early the programs become resident, and the prefetches go out, while the qkv projection runs.

Grid `(PROGRAMS,)`, static, no host read: capturable. CUDA only (inline PTX): the interpreter and the torch
backend have no such op (`KernelOps.l2_prefetch` is None there).
"""
from __future__ import annotations

from typing import Sequence

import torch
import triton
import triton.language as tl

from modeling.ops.pdl import PDL_LAUNCH, pdl_launch_dependents, pdl_wait

LINE = 128  # bytes per prefetch: one L2 line
PROGRAMS = 32
_BLOCK = 1024  # lines per program per step of its loop
MAX_TENSORS = 3


@triton.jit
def _l2_prefetch_kernel(A, a_lines, B, b_lines, C, c_lines, LINE_BYTES: tl.constexpr, BLOCK: tl.constexpr,
                        PDL: tl.constexpr):
    """Prefetch lines [0, a_lines) of A, then of B, then of C (uint8 pointers), grid-strided over the programs."""
    pdl_launch_dependents(PDL)
    ab = a_lines + b_lines
    total = ab + c_lines
    for start in range(tl.program_id(0) * BLOCK, total, tl.num_programs(0) * BLOCK):
        i = start + tl.arange(0, BLOCK)
        in_a = i < a_lines
        in_b = (i >= a_lines) & (i < ab)
        pa = A + tl.where(in_a, i, 0).to(tl.int64) * LINE_BYTES
        pb = B + tl.where(in_b, i - a_lines, 0).to(tl.int64) * LINE_BYTES
        pc = C + tl.where((i >= ab) & (i < total), i - ab, 0).to(tl.int64) * LINE_BYTES
        ptr = tl.where(in_a, pa, tl.where(in_b, pb, pc))
        tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptr],
                                  dtype=tl.int32, is_pure=False, pack=1)
    pdl_wait(PDL)


def prefetch_plan(weights: Sequence[torch.Tensor], max_bytes: int) -> list[tuple[torch.Tensor, int]]:
    """(uint8 view, whole lines) of each of the first `MAX_TENSORS` weights, in order, until `max_bytes` are
    planned; a tensor past the budget gets 0 lines. Weights must be contiguous."""
    plan, left = [], max(0, max_bytes)
    for w in list(weights)[:MAX_TENSORS]:
        if not w.is_contiguous():
            raise ValueError(f"l2_prefetch needs contiguous weights, got strides {w.stride()}")
        lines = min(w.numel() * w.element_size(), left) // LINE
        plan.append((w.view(-1).view(torch.uint8), lines))
        left -= lines * LINE
    return plan


def l2_prefetch(weights: Sequence[torch.Tensor], *, max_bytes: int, pdl: int = 0) -> None:
    """Prefetch into L2 the first `max_bytes` of `weights` (in order, at most `MAX_TENSORS`, contiguous CUDA
    tensors that no kernel of the step writes), on the current stream. Returns at once; nothing is written."""
    plan = prefetch_plan(weights, max_bytes)
    if not plan or sum(lines for _, lines in plan) == 0:
        return
    while len(plan) < MAX_TENSORS:
        plan.append((plan[0][0], 0))
    (a, na), (b, nb), (c, nc) = plan
    _l2_prefetch_kernel[(PROGRAMS,)](a, na, b, nb, c, nc, LINE_BYTES=LINE, BLOCK=_BLOCK, num_warps=4,
                                     **PDL_LAUNCH[pdl])
