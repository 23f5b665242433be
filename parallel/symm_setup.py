"""Set-up of a TP group's symmetric-memory all-reduce (`parallel.symm_allreduce.SymmMemAllReduce`): every rank of
the group calls `try_create_for_group` together, and each stage (local checks; allocation + rendezvous; a numeric
probe per dtype and variant; the fused add + RMSNorm kernel's buffers and probe) is agreed by all-gathering
per-rank success flags over the group's own NCCL communicator, so every rank reaches the same verdict (see
`parallel.symm_allreduce` for why a split decision deadlocks)."""
from __future__ import annotations

import logging
import time
from typing import Any, Optional

import torch
import torch.distributed as dist

from parallel.options import FUSED_KINDS, CommOptions
from parallel.symm_allreduce import (CANDIDATE_DTYPES, DEFAULT_MAX_BYTES, MAX_WORLD, VARIANTS, SymmMemAllReduce,
                                     _group_name, _symm_mem_module, available_ops)

log = logging.getLogger(__name__)


def _gather_ints(values: list[int], group: Any, device: torch.device) -> torch.Tensor:
    """`[world, len(values)]` int64 (CPU) of every rank's values (collective over `group`)."""
    mine = torch.tensor(values, dtype=torch.int64, device=device)
    out = torch.empty((dist.get_world_size(group), len(values)), dtype=torch.int64, device=device)
    dist.all_gather_into_tensor(out, mine, group=group)
    return out.cpu()


def _agree(ok: bool, reason: str, group: Any, device: torch.device, stage: str) -> tuple[bool, str]:
    flags = _gather_ints([int(ok)], group, device)[:, 0]
    if bool(flags.all()):
        return True, ""
    bad = [i for i, f in enumerate(flags.tolist()) if not f]
    return False, reason if not ok else f"{stage} failed on group rank(s) {bad} (see their logs)"


def try_create_for_group(group: Any, device: torch.device, max_bytes: int = DEFAULT_MAX_BYTES,
                         fused_kind: str = CommOptions.tp_fused_kind, fused_norm: bool = CommOptions.tp_fused_norm,
                         fused_probe: Optional[tuple[int, torch.dtype]] = None,
                         timings: Optional[dict[str, float]] = None) -> tuple[Optional[SymmMemAllReduce], str]:
    """`(impl, description)` or `(None, reason)`; every rank of `group` calls it together and gets the same verdict.
    `fused_kind`: the fused add + RMSNorm kernel ("push" / "pull", `CommOptions.tp_fused_kind`); `fused_norm`:
    False sets up no fused kernel (`CommOptions.tp_fused_norm`).
    `fused_probe`: (hidden size, dtype) of the model the group serves: the fused kernel is probed, and enabled,
    for that shape's dtype only (None: hidden 1024, every dtype it takes); the same on every rank.
    `timings`: filled with seconds per set-up stage ("symm_rendezvous_s", "symm_probe_s", "fused_rendezvous_s",
    "fused_probe_s").

    Decisions that are identical on every rank by construction (device type, group size,
    backend, and the all-gathered device ordinals) return without a further collective;
    everything else is agreed over the group.
    """
    if fused_kind not in FUSED_KINDS:  # before anything is allocated
        raise ValueError(f"fused all-reduce kind {fused_kind!r}: expected one of {', '.join(FUSED_KINDS)}")
    if group is None:
        return None, "no process group"
    if device.type != "cuda":
        return None, f"device {device} is not CUDA"
    world = dist.get_world_size(group)
    if world == 1 or world > MAX_WORLD:
        return None, f"group size {world} outside 2..{MAX_WORLD}"
    backend = str(dist.get_backend(group)).lower()
    if backend != "nccl":
        return None, f"group backend is {backend}, not nccl"

    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    # The CUDA symmetric-memory allocator identifies peers by device ordinal and rejects a
    # rendezvous where two ranks report the same one ("detected allocations from overlapping
    # devices"): the case when each process sees a single GPU (Ray's per-actor
    # CUDA_VISIBLE_DEVICES masking makes every rank cuda:0). Say so before trying.
    ordinals = _gather_ints([device.index], group, device)[:, 0].tolist()
    if len(set(ordinals)) != len(ordinals):
        return None, (f"ranks use overlapping CUDA device ordinals {ordinals}: symmetric memory needs each rank "
                      "on a distinct ordinal of one shared device view (every GPU visible to every process, "
                      "e.g. no per-actor CUDA_VISIBLE_DEVICES masking)")

    ok, reason = True, ""
    try:
        _symm_mem_module()
        if not available_ops():
            ok, reason = False, "no torch.ops.symm_mem.one_shot_all_reduce* op in this torch build"
        else:
            _group_name(group)
    except Exception as e:  # noqa: BLE001 - any import/lookup failure means "unavailable"
        ok, reason = False, f"torch.distributed._symmetric_memory unusable: {type(e).__name__}: {e}"
    ok, reason = _agree(ok, reason, group, device, "symmetric-memory import / op lookup")
    if not ok:
        return None, reason

    timings = timings if timings is not None else {}
    t0 = time.perf_counter()
    impl: Optional[SymmMemAllReduce] = None
    try:
        impl = SymmMemAllReduce(group, device, max_bytes)
        ok, reason = True, ""
    except Exception as e:  # noqa: BLE001
        ok, reason = False, f"allocation/rendezvous failed: {type(e).__name__}: {e}"
    ok, reason = _agree(ok, reason, group, device, "allocation/rendezvous")
    if not ok or impl is None:
        if impl is not None:
            impl.close()
        return None, reason

    t1 = time.perf_counter()
    timings["symm_rendezvous_s"] = t1 - t0
    keys = [(dt, v) for dt in CANDIDATE_DTYPES for v in VARIANTS]
    local = impl.probe()
    agreed = _gather_ints([int(local.get(k, False)) for k in keys], group, device).all(dim=0).tolist()
    passed = {k for k, f in zip(keys, agreed) if f}
    dtypes = frozenset(dt for dt, _ in passed)
    # a variant is kept only if it works for every enabled dtype (one rule per call, no per-dtype variants)
    variants = tuple(v for v in VARIANTS if dtypes and all((dt, v) in passed for dt in dtypes))
    if not dtypes or not variants:
        impl.close()
        return None, "numeric probe failed for every dtype / op variant (see logs)"
    impl.configure(dtypes, variants)
    timings["symm_probe_s"] = time.perf_counter() - t1
    if fused_norm:
        _try_fused(impl, group, device, fused_kind, fused_probe, timings)
    return impl, impl.describe()


def _try_fused(impl: SymmMemAllReduce, group: Any, device: torch.device, kind: str,
               probe: Optional[tuple[int, torch.dtype]], timings: dict[str, float]) -> None:
    """Set up, probe and agree on the fused all-reduce + add + RMSNorm with the `kind` kernel; the plain
    all-reduce stays either way."""
    ok, reason = True, ""
    t0 = time.perf_counter()
    try:
        impl.make_fused(kind)
    except Exception as e:  # noqa: BLE001
        ok, reason = False, f"{type(e).__name__}: {e}"
    ok, reason = _agree(ok, reason, group, device, "fused buffers allocation/rendezvous")
    t1 = time.perf_counter()
    timings["fused_rendezvous_s"] = t1 - t0
    if ok:
        local = impl.probe_fused() if probe is None else impl.probe_fused(probe[0], frozenset({probe[1]}))
        ok, reason = _agree(local, "numeric probe failed", group, device, "fused probe")
    timings["fused_probe_s"] = time.perf_counter() - t1
    impl.enable_fused(ok)
    if not ok:
        log.warning("fused all-reduce + add + RMSNorm unavailable: %s", reason)


def create_for_group(group: Any, device: torch.device, max_bytes: int = DEFAULT_MAX_BYTES
                     ) -> Optional[SymmMemAllReduce]:
    """`try_create_for_group` that logs the reason and returns only the implementation (or None)."""
    impl, why = try_create_for_group(group, device, max_bytes)
    if impl is None:
        log.warning("symmetric-memory all-reduce unavailable: %s", why)
    else:
        log.info("symmetric-memory all-reduce enabled: %s", why)
    return impl
