"""Pieces of the symmetric-memory collectives that both the one-shot all-reduce (`parallel.symm_allreduce`) and the
fused all-reduce + add + RMSNorm kernel (`parallel.symm_fused`) use: the allocation and the largest fused row.
Triton-free (a CPU process imports it)."""
from __future__ import annotations

from typing import Any

import torch

MAX_HIDDEN = 8192  # the fused kernel holds one row in one program's registers


def _symm_mem_module() -> Any:
    """`torch.distributed._symmetric_memory`, imported lazily (CPU-only builds may lack pieces of it)."""
    import torch.distributed._symmetric_memory as symm_mem

    return symm_mem


def symm_empty_bytes(nbytes: int, device: torch.device) -> torch.Tensor:
    """A uint8 `[nbytes]` tensor in symmetric memory on `device` (CUDA), for `rendezvous`: what
    `symm_mem.empty(nbytes, dtype=torch.uint8, device=device)` gives with `TORCH_SYMMMEM_IMPLICIT_POOL=0`,
    without that wrapper's stride helper (`torch._prims_common.make_contiguous_strides_for`), whose first use in a
    process imports sympy, seconds with the GIL held on a rank process without a bytecode cache (figures:
    docs/benchmarks.md, `python -m bench.symm_setup_bench`)."""
    from torch._C._distributed_c10d import _SymmetricMemory

    return _SymmetricMemory.empty_strided_p2p((int(nbytes),), (1,), torch.uint8, device)
