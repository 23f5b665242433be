"""Programmatic dependent launch (PDL) for the decode-path Triton kernels (sm_90 and later).

A kernel launched with PDL may start while the kernel before it in the stream still runs: its programs
become resident as soon as every program of the previous kernel has signalled `gdc_launch_dependents` (or
exited), instead of after that kernel finished and flushed its memory. Inside a CUDA graph the capture keeps
this as a programmatic edge. A decode step is ~200 short kernels in a row, most of them a few microseconds,
so the launch and ramp-up of each kernel hidden under the tail of the previous one is a measurable share.

`PDL: tl.constexpr` is the mode: 0 off, 1 (`KernelOptions.pdl="1"`, `GRAPHLINE_PDL=1`) the next kernel may start
once every program of this one passed its wait, 2 (`"early"`) as soon as every program of this one is resident. Every
kernel that takes it follows three rules:
1. `pdl_launch_dependents(PDL)` first (the early trigger; a no-op in mode 1);
2. before `pdl_wait(PDL)`, only loads of data no kernel of the step writes (weights, norm weights, the step's
   attention lengths and block tables, which host copies write ahead of its first kernel, and KV-cache rows
   older than the step's new tokens);
3. `pdl_wait(PDL)` in every program before any other load, any store or atomic, and any early exit (in mode 1 it
   also triggers the next kernel). The wait returns once the previous kernel completed and its memory is
   visible; since that kernel waited the same way on its own predecessor, everything earlier in the stream is
   complete too (which is why no program may skip the wait, even one with nothing to do).
Launch wrappers take the mode as their `pdl` argument (`modeling.ops.get_kernel_ops` binds `pdl_mode(device,
options.pdl)` once) and pass `**PDL_LAUNCH[pdl]`: `PDL=<mode>, launch_pdl=True` where PDL is on, `PDL=0` elsewhere
(CPU interpreter, GPUs before sm_90, a Triton without the `launch_pdl` option, `pdl="0"`). The default is
`early`, because the decode GEMV (`triton_gemv`) loads its program's whole weight tile before the wait (the A/B
figures are in docs/benchmarks.md, `python -m bench.decode_ab`).
Kernels that spin on other GPUs (the TP fused all-reduce) and the armed-decode gate are never launched with PDL.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch
import triton
import triton.language as tl

from modeling.ops.options import PDL_ENV, KernelOptions

PDL_MODES = {"0": 0, "1": 1, "early": 2}
# launch keyword arguments per mode, built once: a launch indexes this tuple instead of building a dict
PDL_LAUNCH: tuple[dict[str, Any], ...] = ({"PDL": 0}, {"PDL": 1, "launch_pdl": True}, {"PDL": 2, "launch_pdl": True})


@functools.lru_cache(maxsize=None)
def _triton_has_pdl() -> bool:
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
        import triton.language.extra.cuda as cuda_extra
    except ImportError:
        return False
    names = {f.name for f in dataclasses.fields(CUDAOptions)}
    return "launch_pdl" in names and hasattr(cuda_extra, "gdc_wait") and hasattr(cuda_extra, "gdc_launch_dependents")


@functools.lru_cache(maxsize=None)
def _device_has_pdl(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def pdl_supported(device: torch.device) -> bool:
    """Whether kernels on `device` can launch with PDL at all, whatever the option says: CUDA of compute capability
    9.0 or later, a Triton with the `launch_pdl` option, kernels not built for Triton's CPU interpreter (checked
    before any device query)."""
    if device.type != "cuda" or interpreted() or not _triton_has_pdl():
        return False
    return _device_has_pdl(device.index if device.index is not None else torch.cuda.current_device())


def pdl_mode(device: torch.device, requested: str = KernelOptions.pdl) -> int:
    """The PDL mode of kernels launched on `device` (0 off, 1, 2: see the module doc): `requested` ("0", "1" or
    "early", `KernelOptions.pdl`) where `pdl_supported(device)`; 0 elsewhere."""
    if requested not in PDL_MODES:
        raise ValueError(f"{PDL_ENV}={requested!r}: use 0 (off), 1 (trigger after the wait) or early (the default)")
    mode = PDL_MODES[requested]
    return mode if mode and pdl_supported(device) else 0


def pdl_enabled(device: torch.device, requested: str = KernelOptions.pdl) -> bool:
    return pdl_mode(device, requested) != 0


def pdl_launch(device: torch.device, requested: str = KernelOptions.pdl) -> dict[str, Any]:
    """Keyword arguments for a launch of a kernel with a `PDL` constexpr (see the module doc)."""
    return PDL_LAUNCH[pdl_mode(device, requested)]


@triton.jit
def pdl_launch_dependents(PDL: tl.constexpr):
    """Rule 1: in mode 2, let the next kernel in the stream start now."""
    if PDL == 2:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """Rule 3: wait until the previous kernel in the stream completed and its writes are visible; in mode 1, then
    let the next kernel start."""
    if PDL != 0:
        tl.extra.cuda.gdc_wait()
    if PDL == 1:
        tl.extra.cuda.gdc_launch_dependents()


def interpreted() -> bool:
    """Whether this process's kernels run under Triton's CPU interpreter: Triton decides when it builds them (from
    `TRITON_INTERPRET`, which Triton reads itself), and `triton.jit` then returns interpreter functions."""
    return _INTERPRETED


def _built_for_interpreter() -> bool:
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(pdl_wait, InterpretedFunction)


_INTERPRETED = _built_for_interpreter()
