"""All-reduce + residual add + RMSNorm in ONE kernel over NVLink symmetric memory (TP decode path).

Replaces, after a row-parallel projection under TP, the pair "one-shot all-reduce, then
add_rms_norm": each all-reduce costs a cross-GPU barrier whatever its size, and the norm
kernel after it is a second launch that reads the sum back.

Memory (one symmetric allocation per rank, `FusedSymmBuffers`, every peer maps every other):
    [ half 0: max_bytes | half 1: max_bytes | flags: int64 [G, world] ]
One call, program b of G (rows b, b + G, ... of the `[M, H]` input):
1. epoch = epochs[b] + 1 (a per-program int64 counter on the local device); half = epoch % 2;
2. store my partial rows into half `half` of MY buffer;
3. signal: write `epoch` into flags[b, my_rank] of EVERY peer's buffer (release, system scope);
4. wait: spin until flags[b, p] >= epoch in MY buffer for every rank p (acquire, system scope);
5. per row: sum the W partials in rank order (fp32, so every rank gets the same bits), round
   to the input dtype (what an all-reduce returns), then the `add_rms_norm` row: the residual
   sum rounded to its dtype, and the norm of that rounded sum times the weight;
6. epochs[b] = epoch.
Why no closing barrier: the next call writes the OTHER half, and the call after it (same half
again) starts only after its predecessor's wait, which needs every peer's signal of that
predecessor, sent after the peer finished reading. Row-to-program mapping is fixed (G is a
constant), so program b always owns the same rows and its counter and flags stay in
lock-step across ranks, whatever M. Epochs only grow (int64), so flags are never reset.
Requirements: every rank of the group launches the same calls in the same order on one
stream (TP ranks run the same steps), and G programs are co-resident (G <= SM count), since
program b of one rank waits for program b of every peer.
"""
from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

PROGRAMS = 64  # G: programs per call (rows are strided over them); far below any H100/H200 SM count
MAX_HIDDEN = 8192


@triton.jit
def _ar_add_rms_norm_kernel(X, R, W, OUT, SUM, PEERS, EPOCHS, M, eps, half_elems, flag_base,
                            H: tl.constexpr, BLOCK: tl.constexpr, RANK: tl.constexpr, WORLD: tl.constexpr,
                            G: tl.constexpr):
    b = tl.program_id(0)
    epoch = tl.load(EPOCHS + b) + 1
    data = (epoch % 2) * half_elems
    offs = tl.arange(0, BLOCK)
    mask = offs < H
    mine = tl.load(PEERS + RANK).to(tl.pointer_type(X.dtype.element_ty))
    for row in range(b, M, G):
        x = tl.load(X + row * H + offs, mask=mask)
        tl.store(mine + data + row * H + offs, x, mask=mask)
    tl.debug_barrier()
    for p in tl.static_range(WORLD):
        flags = tl.load(PEERS + p).to(tl.pointer_type(tl.int64)) + flag_base
        tl.atomic_xchg(flags + b * WORLD + RANK, epoch, sem="release", scope="sys")
    my_flags = tl.load(PEERS + RANK).to(tl.pointer_type(tl.int64)) + flag_base + b * WORLD
    for p in tl.static_range(WORLD):
        seen = tl.atomic_add(my_flags + p, 0, sem="acquire", scope="sys")
        while seen < epoch:
            seen = tl.atomic_add(my_flags + p, 0, sem="acquire", scope="sys")
    tl.debug_barrier()
    w = tl.load(W + offs, mask=mask, other=0.0).to(tl.float32)
    for row in range(b, M, G):
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for p in tl.static_range(WORLD):
            peer = tl.load(PEERS + p).to(tl.pointer_type(X.dtype.element_ty))
            acc += tl.load(peer + data + row * H + offs, mask=mask, other=0.0, cache_modifier=".cv").to(tl.float32)
        y = acc.to(X.dtype.element_ty).to(tl.float32)  # what the all-reduce would have returned
        r = tl.load(R + row * H + offs, mask=mask, other=0.0).to(tl.float32)
        s = (y + r).to(SUM.dtype.element_ty)
        tl.store(SUM + row * H + offs, s, mask=mask)
        sf = s.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(sf * sf, axis=0) / H + eps)
        n = (sf * rstd).to(SUM.dtype.element_ty).to(tl.float32)
        tl.store(OUT + row * H + offs, (n * w).to(OUT.dtype.element_ty), mask=mask)
    tl.store(EPOCHS + b, epoch)


class FusedSymmBuffers:
    """One rank's symmetric allocation for `all_reduce_add_rms_norm` over `group_name` (see the module docstring).

    Built by every rank of the group together (rendezvous), outside any CUDA graph capture; lives as long as
    the group's `SymmMemAllReduce`. `max_bytes`: the largest `[M, H]` input, in bytes.
    """

    def __init__(self, group_name: str, device: torch.device, world: int, rank: int, max_bytes: int):
        import torch.distributed._symmetric_memory as symm_mem

        self.world, self.rank, self.device = world, rank, device
        self.half_bytes = -(-int(max_bytes) // 16) * 16
        flag_bytes = PROGRAMS * world * 8
        with torch.cuda.device(device):
            self.buffer = symm_mem.empty(2 * self.half_bytes + flag_bytes, dtype=torch.uint8, device=device)
            self.buffer.zero_()
            handle = symm_mem.rendezvous(self.buffer, group_name)
            if handle is None:
                raise RuntimeError("symm_mem.rendezvous returned no handle")
            self.peers = torch.tensor([int(p) for p in handle.buffer_ptrs], dtype=torch.int64, device=device)
            self.epochs = torch.zeros(PROGRAMS, dtype=torch.int64, device=device)
        self._handle: Any = handle
        if len(handle.buffer_ptrs) != world:
            raise RuntimeError(f"rendezvous mapped {len(handle.buffer_ptrs)} buffers for a group of {world}")
        torch.cuda.synchronize(device)  # every rank's zeroed flags before any peer signals into them

    def fits(self, x: torch.Tensor) -> bool:
        return x.numel() * x.element_size() <= self.half_bytes

    def all_reduce_add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                                eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(rms_norm(sum + residual) * weight, sum + residual) for sum = x summed over the group; x and residual
        `[M, H]` contiguous of one dtype, weight `[H]`; both outputs new tensors of x's dtype. Stream: the
        current one (capturable). The caller checked the layout (`SymmMemAllReduce.can_fuse_add_rms_norm`)."""
        m, h = x.shape
        out = torch.empty_like(x)
        s = torch.empty_like(x)
        block = triton.next_power_of_2(h)
        _ar_add_rms_norm_kernel[(PROGRAMS,)](
            x, residual, weight, out, s, self.peers, self.epochs, m, eps,
            self.half_bytes // x.element_size(), (2 * self.half_bytes) // 8,
            H=h, BLOCK=block, RANK=self.rank, WORLD=self.world, G=PROGRAMS,
            num_warps=4 if block <= 2048 else 8,
        )
        return out, s

    def close(self) -> None:
        self._handle = None
        self.buffer = None
