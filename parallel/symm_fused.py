"""All-reduce + residual add + RMSNorm in ONE kernel over NVLink symmetric memory (TP decode path).

Replaces, after a row-parallel projection under TP, the pair "one-shot all-reduce, then
add_rms_norm": each all-reduce costs a cross-GPU barrier whatever its size, and the norm
kernel after it is a second launch that reads the sum back.

Pull kind (`kind="pull"`). Memory (one symmetric allocation per rank, `FusedSymmBuffers`, every peer
maps every other):
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

Push kind (`kind="push"`, the default; 16-bit dtypes): no flags and no remote reads. Memory:
    [ half 0: world slots of max_bytes | half 1: world slots of max_bytes ], every element
    initialised to the EMPTY mark (the bit pattern of -0.0).
One call, program b: epoch and half as above;
1. push: store my partial rows into slot RANK of half `half` of EVERY peer's buffer, with -0.0
   sent as +0.0 (so data is never the mark);
2. per row, per peer p in rank order: spin on volatile loads of slot p in MY buffer until no
   element is the mark, add it to the fp32 sum (my own rows from registers), then store the
   mark back (the slot is clean for the call two calls later); then the add + norm of step 5;
3. epochs[b] = epoch.
Why this is safe: a peer writes half h of my buffer again only two calls later, and it can
start that call only after it read my rows of the call in between, which I push after I
cleared half h (an earlier kernel launch, so the clear is performed first). One crossing of
NVLink per call (the push) instead of three (signal, wait, remote read).
"""
from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from parallel.options import FUSED_KINDS as KINDS
from parallel.symm_memory import MAX_HIDDEN, symm_empty_bytes  # noqa: F401 - MAX_HIDDEN: this kernel's row limit

# The row count M only bounds each program's row loop: specialising it (M == 1, M % 16 == 0) would compile three
# variants per dtype, each about a second on a cold cache, during the process-group set-up's probe.
PROGRAMS = 64  # G: programs per call (rows are strided over them); far below any H100/H200 SM count


@triton.jit
def _add_rms_norm_row(acc, R, OUT, SUM, w, row, offs, mask, eps, DTYPE: tl.constexpr, H: tl.constexpr):
    """Both kernels' epilogue for one row: `acc` (fp32, the partials summed in rank order) rounded to the input
    dtype as an all-reduce returns it, plus the residual row of R (rounded to SUM's dtype, stored to SUM), then
    that rounded sum's RMSNorm times `w` (fp32 weights) stored to OUT."""
    y = acc.to(DTYPE).to(tl.float32)
    r = tl.load(R + row * H + offs, mask=mask, other=0.0).to(tl.float32)
    s = (y + r).to(SUM.dtype.element_ty)
    tl.store(SUM + row * H + offs, s, mask=mask)
    sf = s.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(sf * sf, axis=0) / H + eps)
    n = (sf * rstd).to(SUM.dtype.element_ty).to(tl.float32)
    tl.store(OUT + row * H + offs, (n * w).to(OUT.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["M"])  # one variant per dtype, whatever the row count
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
        _add_rms_norm_row(acc, R, OUT, SUM, w, row, offs, mask, eps, X.dtype.element_ty, H)
    tl.store(EPOCHS + b, epoch)


EMPTY_BITS = -32768  # int16 bit pattern of -0.0 in bf16 and fp16: the push kind's "not arrived" mark


@triton.jit(do_not_specialize=["M"])
def _ar_push_add_rms_norm_kernel(X, R, W, OUT, SUM, PEERS, EPOCHS, M, eps, half_elems, slot_elems,
                                 H: tl.constexpr, BLOCK: tl.constexpr, RANK: tl.constexpr, WORLD: tl.constexpr,
                                 G: tl.constexpr, EMPTY: tl.constexpr):
    b = tl.program_id(0)
    epoch = tl.load(EPOCHS + b) + 1
    data = (epoch % 2) * half_elems
    offs = tl.arange(0, BLOCK)
    mask = offs < H
    for row in range(b, M, G):
        x = tl.load(X + row * H + offs, mask=mask)
        x = tl.where(x == 0, tl.zeros_like(x), x)  # -0.0 is the mark
        for p in tl.static_range(WORLD):
            if p != RANK:
                peer = tl.load(PEERS + p).to(tl.pointer_type(X.dtype.element_ty))
                tl.store(peer + data + RANK * slot_elems + row * H + offs, x, mask=mask)
    mine = tl.load(PEERS + RANK).to(tl.pointer_type(tl.int16))
    w = tl.load(W + offs, mask=mask, other=0.0).to(tl.float32)
    for row in range(b, M, G):
        x = tl.load(X + row * H + offs, mask=mask, other=0.0)
        x = tl.where(x == 0, tl.zeros_like(x), x)
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for p in tl.static_range(WORLD):
            if p == RANK:
                acc += x.to(tl.float32)
            else:
                slot = mine + data + p * slot_elems + row * H + offs
                bits = tl.load(slot, mask=mask, other=0, volatile=True)
                while tl.max(tl.where(bits == EMPTY, 1, 0), axis=0) > 0:
                    bits = tl.load(slot, mask=mask, other=0, volatile=True)
                acc += bits.to(X.dtype.element_ty, bitcast=True).to(tl.float32)
                tl.store(slot, tl.full((BLOCK,), EMPTY, tl.int16), mask=mask)
        _add_rms_norm_row(acc, R, OUT, SUM, w, row, offs, mask, eps, X.dtype.element_ty, H)
    tl.store(EPOCHS + b, epoch)


def _kernel_call(kind: str, x: Any, residual: Any, weight: Any, out: Any, s: Any, peers: Any, epochs: Any, m: int,
                 eps: float, h: int, elem_size: int, half_bytes: int, rank: int, world: int
                 ) -> tuple[Any, tuple, dict[str, Any]]:
    """(kernel, positional args, meta-parameters) of one fused call: the one place both the launch and the
    compile-only warm-up (`warm_up_compile`, with dtypes in place of tensors) take them from, so that both
    specialise alike."""
    block = triton.next_power_of_2(h)
    meta = dict(H=h, BLOCK=block, RANK=rank, WORLD=world, G=PROGRAMS, num_warps=4 if block <= 2048 else 8)
    if kind == "push":
        slot = half_bytes // elem_size
        return (_ar_push_add_rms_norm_kernel, (x, residual, weight, out, s, peers, epochs, m, eps, world * slot, slot),
                {**meta, "EMPTY": EMPTY_BITS})
    return (_ar_add_rms_norm_kernel,
            (x, residual, weight, out, s, peers, epochs, m, eps, half_bytes // elem_size, (2 * half_bytes) // 8), meta)


def _half_bytes(max_bytes: int) -> int:
    """One half of a rank's fused buffer for inputs up to `max_bytes` (rounded up to 16 bytes): the launch's integer
    arguments derive from it, so the buffers and the compile-only warm-up must round alike."""
    return -(-int(max_bytes) // 16) * 16


def warm_up_compile(hidden: int, dtype: torch.dtype, rank: int, world: int, max_bytes: int, kind: str = "push",
                    eps: float = 1e-6) -> None:
    """Compile (without launching, with no buffers and no peers) the fused kernel `FusedSymmBuffers` of this
    `kind`, `max_bytes`, group rank and size will launch for `[M, hidden]` inputs of `dtype`, into Triton's caches;
    on the current CUDA device. Lets a rank compile it before its process groups exist."""
    elem = torch.empty((), dtype=dtype).element_size()
    kernel, args, meta = _kernel_call(kind, dtype, dtype, dtype, dtype, dtype, torch.int64, torch.int64, 1, eps,
                                      hidden, elem, _half_bytes(max_bytes), rank, world)
    kernel.warmup(*args, grid=(PROGRAMS,), **meta)


class FusedSymmBuffers:
    """One rank's symmetric allocation for `all_reduce_add_rms_norm` over `group_name` (see the module docstring).

    Built by every rank of the group together (rendezvous), outside any CUDA graph capture; lives as long as
    the group's `SymmMemAllReduce`. `max_bytes`: the largest `[M, H]` input, in bytes. `kind`: "push" (bf16 /
    fp16 only) or "pull" (bf16 / fp16 / fp32), `CommOptions.tp_fused_kind`. `dtypes`: what this kind reduces.
    """

    def __init__(self, group_name: str, device: torch.device, world: int, rank: int, max_bytes: int,
                 kind: str | None = None):
        import torch.distributed._symmetric_memory as symm_mem

        self.kind = kind if kind is not None else "push"
        if self.kind not in KINDS:
            raise ValueError(f"fused all-reduce kind {self.kind!r}: expected one of {', '.join(KINDS)}")
        self.world, self.rank, self.device = world, rank, device
        self.half_bytes = _half_bytes(max_bytes)
        if self.kind == "push":
            self.dtypes = frozenset({torch.bfloat16, torch.float16})
            size = 2 * world * self.half_bytes
        else:
            self.dtypes = frozenset({torch.bfloat16, torch.float16, torch.float32})
            size = 2 * self.half_bytes + PROGRAMS * world * 8
        with torch.cuda.device(device):
            self.buffer = symm_empty_bytes(size, device)
            if self.kind == "push":
                self.buffer.view(torch.int16).fill_(EMPTY_BITS)
            else:
                self.buffer.zero_()
            handle = symm_mem.rendezvous(self.buffer, group_name)
            if handle is None:
                raise RuntimeError("symm_mem.rendezvous returned no handle")
            self.peers = torch.tensor([int(p) for p in handle.buffer_ptrs], dtype=torch.int64, device=device)
            self.epochs = torch.zeros(PROGRAMS, dtype=torch.int64, device=device)
        self._handle: Any = handle
        if len(handle.buffer_ptrs) != world:
            raise RuntimeError(f"rendezvous mapped {len(handle.buffer_ptrs)} buffers for a group of {world}")
        torch.cuda.synchronize(device)  # every rank's initialised buffer before any peer writes into it

    def fits(self, x: torch.Tensor) -> bool:
        return x.dtype in self.dtypes and x.numel() * x.element_size() <= self.half_bytes

    def all_reduce_add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                                eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(rms_norm(sum + residual) * weight, sum + residual) for sum = x summed over the group; x and residual
        `[M, H]` contiguous of one dtype, weight `[H]`; both outputs new tensors of x's dtype. Stream: the
        current one (capturable). The caller checked the layout (`SymmMemAllReduce.can_fuse_add_rms_norm`)."""
        m, h = x.shape
        out = torch.empty_like(x)
        s = torch.empty_like(x)
        kernel, args, meta = _kernel_call(self.kind, x, residual, weight, out, s, self.peers, self.epochs, m, eps, h,
                                          x.element_size(), self.half_bytes, self.rank, self.world)
        kernel[(PROGRAMS,)](*args, **meta)
        return out, s

    def close(self) -> None:
        self._handle = None
        self.buffer = None
