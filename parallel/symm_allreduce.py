"""One-shot all-reduce of small tensors over NVLink through PyTorch symmetric memory.

Each rank owns one symmetric buffer (`symm_empty_bytes`, then `rendezvous` with the group):
every peer maps every other peer's buffer. An all-reduce is ONE kernel,
`torch.ops.symm_mem.one_shot_all_reduce*`: the rank writes its input into its
own buffer, a device-side barrier (signal pads) waits for the peers, then each rank reads
every peer's buffer and sums into a fresh output; a closing barrier keeps the buffer from
being overwritten while a peer still reads it. No host synchronisation and fixed addresses,
so it is capturable in CUDA graphs; no multicast (`multimem_*`) is used, so it works with
NVLS / multicast disabled.

Op variants, probed with `hasattr` at run time (PyTorch's op set moves between releases):
- fused  `one_shot_all_reduce_copy_out(symm_view, x, "sum", group, out)` or `one_shot_all_reduce_copy`:
  the kernel copies `x` into the buffer itself (one launch);
- plain  `view.copy_(x)` then `one_shot_all_reduce_out(view, "sum", group, out)` or `one_shot_all_reduce`.
The fused kernel requires `x` and the buffer view to have the same alignment (it checks the
storage offset), so unaligned inputs take the plain path.

Kernel facts (torch/csrc/distributed/c10d/symm_mem/CUDASymmetricMemoryOps.cu): contiguous
input and output, reduce op "sum" only, bf16 and fp32 only (fp16 is probed, not assumed),
size in bytes a multiple of 4, world sizes 2/4/8 specialised (others generic).

Agreement: every rank of the group must take the same decision, or the first all-reduce
deadlocks (one rank in the symmetric kernel, the other in NCCL). `parallel.symm_setup.try_create_for_group`
therefore agrees collectively at each stage (local checks; allocation + rendezvous; a
numeric probe per dtype and variant) by all-gathering per-rank success flags over the
group's own NCCL communicator, and enables only what succeeded on every rank. Residual
risk: a rank that fails *inside* `rendezvous` after a peer entered it leaves that peer
waiting on the store until its timeout; the peer then fails too, so both still agree.
`can_reduce` is a pure function of shape, dtype and layout, identical on every rank of a
TP group (TP ranks run the same batch), so per-call decisions agree as well.

Calls for one group must be ordered on one stream (the model's forward stream): the group
has a single buffer.

Fused with the residual add + RMSNorm that follows a row-parallel projection:
`all_reduce_add_rms_norm` (a Triton kernel over a second symmetric allocation,
`parallel.symm_fused`), enabled after its own agreed numeric probe; `can_fuse_add_rms_norm`
decides per call, from shapes and dtypes only.
"""
from __future__ import annotations

import logging
from typing import Any, Optional

import torch
import torch.distributed as dist

from parallel.symm_memory import MAX_HIDDEN, _symm_mem_module, symm_empty_bytes

log = logging.getLogger(__name__)

IMPL_NAME = "symm_mem_one_shot"
DEFAULT_MAX_BYTES = 1 << 20  # decode up to 256 tokens x 2048 hidden in bf16
MAX_WORLD = 8
CANDIDATE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_ALIGN = 16  # bytes; the kernel's widest vector
_FUSED_OPS = ("one_shot_all_reduce_copy_out", "one_shot_all_reduce_copy")
_PLAIN_OPS = ("one_shot_all_reduce_out", "one_shot_all_reduce")
VARIANTS = ("fused", "plain")


class SymmMemError(RuntimeError):
    """Symmetric memory could not be set up, or was used outside what `can_reduce` allows."""


def _op(name: str) -> Optional[Any]:
    ns = getattr(torch.ops, "symm_mem", None)
    if ns is None:
        return None
    try:
        return getattr(ns, name) if hasattr(ns, name) else None
    except (AttributeError, RuntimeError):
        return None


def available_ops() -> dict[str, str]:
    """The one-shot op chosen for each variant in this torch build (`{}` when none exists)."""
    found: dict[str, str] = {}
    for variant, names in (("fused", _FUSED_OPS), ("plain", _PLAIN_OPS)):
        for name in names:
            if _op(name) is not None:
                found[variant] = name
                break
    return found


def _group_name(group: Any) -> str:
    name = getattr(group, "group_name", None)
    if not name:
        name = dist.distributed_c10d._get_process_group_name(group)
    return str(name)


def _aligned(x: torch.Tensor) -> bool:
    return (x.storage_offset() * x.element_size()) % _ALIGN == 0


class SymmMemAllReduce:
    """One symmetric buffer of `max_bytes` per rank for `group`; `all_reduce(x)` returns a new summed tensor.

    The constructor allocates and rendezvouses the buffer: all ranks of the group call it
    together, outside any CUDA graph capture. Prefer `try_create_for_group`, which also
    agrees on availability and probes correctness. Enabled dtypes / variants start as every
    candidate the build has; `configure` narrows them to what the probe proved.
    """

    def __init__(self, group: Any, device: torch.device, max_bytes: int = DEFAULT_MAX_BYTES):
        if device.type != "cuda":
            raise SymmMemError(f"symmetric memory needs a CUDA device, got {device}")
        ops = available_ops()
        if not ops:
            raise SymmMemError("this torch build has no torch.ops.symm_mem.one_shot_all_reduce* op")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.group = group
        self.group_name = _group_name(group)
        self.device = device
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.max_bytes = -(-int(max_bytes) // _ALIGN) * _ALIGN
        self.enabled = True
        self._ops: dict[str, str] = ops
        self._fns: dict[str, Any] = {v: _op(name) for v, name in ops.items()}
        self._variants: tuple[str, ...] = tuple(v for v in VARIANTS if v in ops)
        self.dtypes: frozenset[torch.dtype] = frozenset(CANDIDATE_DTYPES)
        self.preferred: str = self._variants[0]
        symm_mem = _symm_mem_module()
        # `enable_symm_mem_for_group` is deliberately not called: deprecated ("no need to call this
        # function anymore"), and its name-keyed store cache goes stale when groups are re-created.
        with torch.cuda.device(device):
            self._buffer: Optional[torch.Tensor] = symm_empty_bytes(self.max_bytes, device)
            self._buffer.zero_()
            self._handle: Any = symm_mem.rendezvous(self._buffer, self.group_name)
            if self._handle is None:
                raise SymmMemError("symm_mem.rendezvous returned no handle")
        self._flat: dict[torch.dtype, torch.Tensor] = {}
        for dt in CANDIDATE_DTYPES:
            self._flat[dt] = self._buffer.view(dt)
        self._fused: Optional[Any] = None  # parallel.symm_fused.FusedSymmBuffers once `enable_fused` agreed
        self._fused_pending: Optional[Any] = None  # allocated by `make_fused`, not yet agreed on

    # ---- the fused all-reduce + add + RMSNorm
    def make_fused(self, kind: Optional[str] = None) -> None:
        """Allocate and rendezvous the fused kernel's buffers (every rank together); enabled by `enable_fused`.
        `kind`: "push" or "pull" (`parallel.symm_fused`; None: push, `CommOptions.tp_fused_kind`'s default)."""
        from parallel.symm_fused import FusedSymmBuffers

        self._fused_pending = FusedSymmBuffers(self.group_name, self.device, self.world_size, self.rank, self.max_bytes,
                                               kind)

    def enable_fused(self, on: bool) -> None:
        pending = getattr(self, "_fused_pending", None)
        self._fused_pending = None
        self._fused = pending if on else None
        if not on and pending is not None:
            pending.close()

    @property
    def fused(self) -> bool:
        return self._fused is not None

    def can_fuse_add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> bool:
        """Whether `all_reduce_add_rms_norm` may run: a pure function of shapes, dtypes and layout (the same on
        every rank of the group) plus the agreed enable flag."""
        f = self._fused
        if f is None or not self.enabled or not x.is_cuda or x.device != self.device or x.dim() != 2:
            return False
        if x.dtype not in self.dtypes or residual.dtype != x.dtype or weight.dtype != x.dtype:  # f.fits: its dtypes
            return False
        if residual.shape != x.shape or weight.shape != (x.shape[1],) or x.shape[1] > MAX_HIDDEN or x.numel() == 0:
            return False
        return x.is_contiguous() and residual.is_contiguous() and weight.is_contiguous() and f.fits(x)

    def all_reduce_add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                                eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(rms_norm(all_reduce(x) + residual) * weight, all_reduce(x) + residual), new tensors; one kernel.
        Capturable; call only when `can_fuse_add_rms_norm`."""
        return self._fused.all_reduce_add_rms_norm(x, residual, weight, eps)

    def probe_fused(self, hidden: int = 1024, dtypes: Optional[frozenset[torch.dtype]] = None) -> bool:
        """Run the fused kernel on exact `[M, hidden]` inputs of each dtype it and the all-reduce both take
        (narrowed to `dtypes` when given: the model's, so no variant the model never runs gets compiled) and
        compare with the unfused arithmetic; the fused kernel then takes only the dtypes probed. No exceptions
        escape."""
        f = getattr(self, "_fused_pending", None)
        if f is None:
            return False
        probed = self.dtypes & f.dtypes if dtypes is None else self.dtypes & f.dtypes & dtypes
        if not probed:
            return False
        try:
            ok = True
            for dt in sorted(probed, key=str):
                for m in (1, 3, 64, 130):
                    h = hidden
                    base = ((torch.arange(m * h, device=self.device) % 5) - 2).to(dt).view(m, h)
                    g = torch.Generator(device=self.device).manual_seed(1234 + m)
                    res = torch.randn(m, h, generator=g, device=self.device).to(dt)
                    w = (torch.rand(h, generator=g, device=self.device) + 0.5).to(dt)
                    for _ in range(3):  # both halves, and a reuse of the first
                        out, s = f.all_reduce_add_rms_norm(base * (self.rank + 1), res, w, 1e-6)
                        y = (base * (self.world_size * (self.world_size + 1) // 2)).float()
                        want_s = (y + res.float()).to(dt)
                        sf = want_s.float()
                        n = (sf * torch.rsqrt(sf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dt).float()
                        want = (n * w.float()).to(dt)
                        ok = ok and torch.equal(s, want_s) and bool(
                            torch.allclose(out.float(), want.float(), rtol=2e-2, atol=2e-2))
            torch.cuda.synchronize(self.device)
            f.dtypes = frozenset(probed)
            return ok
        except Exception as e:  # noqa: BLE001 - a kernel that cannot build here is a normal outcome
            log.info("fused all-reduce + add + RMSNorm probe failed: %s", e)
            return False

    # ---- configuration
    @property
    def variants(self) -> tuple[str, ...]:
        """Usable variants, best first ("fused": copy inside the kernel; "plain": copy, then the kernel)."""
        return self._variants

    def configure(self, dtypes: frozenset[torch.dtype], variants: tuple[str, ...]) -> None:
        """Restrict to what every rank proved to work (`try_create_for_group` calls it with agreed sets)."""
        bad = [v for v in variants if v not in self._ops]
        if bad or not variants:
            raise SymmMemError(f"variants {variants} not available (have {tuple(self._ops)})")
        self.dtypes = frozenset(dtypes)
        self._variants = tuple(v for v in VARIANTS if v in variants)
        self.preferred = self._variants[0]

    def use_variant(self, variant: str) -> None:
        """Force one variant (benchmarks); must be in `variants`."""
        if variant not in self._variants:
            raise SymmMemError(f"variant {variant!r} not usable here (usable: {self._variants})")
        self.preferred = variant

    def describe(self) -> str:
        names = ", ".join(str(d).removeprefix("torch.") for d in CANDIDATE_DTYPES if d in self.dtypes)
        ops = "+".join(self._ops[v] for v in self._variants)
        fused = f"; fused with add + RMSNorm ({self._fused.kind} kernel)" if self._fused is not None else ""
        return (f"{IMPL_NAME} ({ops}) for contiguous {names} tensors <= {self.max_bytes} bytes over "
                f"{self.world_size} ranks{fused}; NCCL otherwise")

    # ---- the collective
    def can_reduce(self, x: torch.Tensor) -> bool:
        """True when `all_reduce(x)` may run: same decision on every rank for the same shape/dtype/layout."""
        if not self.enabled or self._buffer is None or not x.is_cuda or x.device != self.device:
            return False
        if x.dtype not in self.dtypes or not x.is_contiguous():
            return False
        nbytes = x.numel() * x.element_size()
        if nbytes == 0 or nbytes > self.max_bytes or nbytes % 4:
            return False
        return "plain" in self._variants or _aligned(x)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of `x` over the group as a NEW tensor (x unchanged). Capturable; call only when `can_reduce(x)`."""
        if self._buffer is None:
            raise SymmMemError("SymmMemAllReduce used after close()")
        view = self._flat[x.dtype][: x.numel()].view(x.shape)
        variant = self.preferred
        if variant == "fused" and not _aligned(x):
            variant = "plain"
        return self._run(variant, view, x)

    def _run(self, variant: str, view: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        name, op = self._ops[variant], self._fns[variant]
        if name == "one_shot_all_reduce_copy_out":
            out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
            return op(view, x, "sum", self.group_name, out)
        if name == "one_shot_all_reduce_copy":
            return op(view, x, "sum", self.group_name)
        view.copy_(x)
        if name == "one_shot_all_reduce_out":
            out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
            return op(view, "sum", self.group_name, out)
        return op(view, "sum", self.group_name)

    def close(self) -> None:
        """Drop the buffer (idempotent). No device synchronisation: a peer may be gone after a failure."""
        self.enabled = False
        self.enable_fused(False)
        self._flat = {}
        self._handle = None
        self._buffer = None

    # ---- start-up probe (eager, outside capture, every rank together)
    def probe(self) -> dict[tuple[torch.dtype, str], bool]:
        """Run each (dtype, variant) once on exact small integers and check the sum; no exceptions escape.

        Exceptions raised here are host-side argument checks that are deterministic for a given
        torch build and shape, so every rank fails or passes them alike (no rank is left in the kernel).
        """
        results: dict[tuple[torch.dtype, str], bool] = {}
        w = self.world_size
        for dt in CANDIDATE_DTYPES:
            for variant in VARIANTS:
                if variant not in self._ops:
                    continue
                ok = True
                for numel in (2, 1024 * 3, self.max_bytes // torch.empty((), dtype=dt).element_size()):
                    try:
                        base = (torch.arange(numel, device=self.device) % 7 + 1).to(dt)
                        x = base * (self.rank + 1)
                        got = self._run(variant, self._flat[dt][:numel], x)
                        ok = ok and bool(torch.equal(got, base * (w * (w + 1) // 2)))
                    except Exception as e:  # noqa: BLE001 - an unsupported dtype/variant is a normal outcome
                        log.info("symm_mem probe %s/%s numel=%d failed: %s", dt, variant, numel, e)
                        ok = False
                        break
                results[(dt, variant)] = ok
        torch.cuda.synchronize(self.device)
        return results
