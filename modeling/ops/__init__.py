"""Operators behind one interface, picked by device: the torch reference (CPU and GPU) and
Triton CUDA kernels (GPU). `get_kernel_ops(device, prefer, options)` returns a `KernelOps` whose
functions have identical signatures in both backends (see `attention_ref.py`, `fused_ref.py`).
The Triton backend binds the rank's `KernelOptions` (PDL mode for this device, GEMV on/off, decode
combine, projection measurement) into its functions once, so a launch reads no option; the process-wide state a
launch does read (split-K counters, the projection fallbacks chosen at warm-up) is documented where it lives
(`triton_gemm`, `projection_choice`)."""
from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from modeling.ops import attention_ref, fused_ref
from modeling.ops.options import KernelOptions


@dataclass(frozen=True)
class KernelOps:
    """name: "torch" or "triton". `capturable`: the decode-path kernels have static grids and no host sync."""

    name: str
    store_kv: Callable
    prefill_attention: Callable
    decode_attention: Callable
    rms_norm: Callable
    add_rms_norm: Callable
    qk_norm_rope: Callable
    qk_norm_rope_store: Callable  # qk_norm_rope then store_kv of its k (and v), one kernel where the backend can
    silu_and_mul: Callable
    linear: Callable
    silu_mul_linear: Callable  # linear(silu_and_mul(x), w), fused where the backend can
    linear_add_rms_norm: Callable  # add_rms_norm(linear(x, w) or silu_mul_linear(x, w), residual, ...), one kernel where it can
    # (x, residual | None, norm_weight, eps, w, gated=) -> (linear(norm(x + residual), w), x + residual); gated:
    # the first output is silu_and_mul'ed. One kernel where the backend can (the GEMV up to
    # `prologue_norm_max_tokens` rows).
    norm_linear: Callable
    # (x, residual | None, norm_weight, eps, w) -> (linear(normed, w), normed, x + residual), normed = the RMSNorm of
    # x + residual: `norm_linear` (ungated) that keeps the normed rows for another consumer (a MoE block's experts
    # after its router). One GEMV launch where the backend can, else the norm and `F.linear`.
    norm_linear_normed: Callable
    capturable: bool
    # Up to this many tokens the model runs the norm before each projection inside it (`norm_linear`: the residual
    # add + RMSNorm in the GEMV's prologue) instead of after the projection before it (`linear_add_rms_norm`).
    prologue_norm_max_tokens: int = 0
    # (k_cache, v_cache, num_q_heads, scale) -> launches: compile every attention variant serving can pick
    warm_up_attention: Callable = lambda k_cache, v_cache, num_q_heads, scale: 0
    options: KernelOptions = field(default_factory=KernelOptions)  # what the functions were bound with
    # Routed-expert MoE (`triton_moe.routed_experts` / `packed_experts` signatures; capturable at every size; the
    # Triton backend's routed one is `triton_moe_pairs.routed_experts_by_size`), or
    # None where the backend has none (the MoE block then takes the torch paths of `moe_ref`).
    moe_routed: Callable | None = None
    moe_packed: Callable | None = None
    # (router_logits [N, E], top_k, renormalize) -> (weights fp32, ids int64), one launch (`triton_router.route_topk`),
    # or None: the MoE block routes with the torch `modeling.moe.route`.
    moe_route: Callable | None = None
    # (hidden [T, H], router weight [E, H]) -> router logits [T, E] (`triton_gemm.router_linear`: the decode GEMV at
    # few rows), or None: `F.linear`.
    moe_router_linear: Callable | None = None
    # (shapes [(N, K)], device, dtype, forms={(N, K): form}) -> {(N, K, row class): Choice}: choose the decode
    # projections' fallbacks outside capture (`triton_gemm_measure`), each measured in the form the model runs it;
    # nothing to choose for the torch backend or with the option off.
    measure_projections: Callable = lambda shapes, device, dtype, forms=None: {}


def _collect(name: str, attention, fused, linear: Callable, silu_mul_linear: Callable, linear_add_rms_norm: Callable,
             norm_linear: Callable, norm_linear_normed: Callable, capturable: bool,
             prologue_norm_max_tokens: int) -> KernelOps:
    return KernelOps(name=name, store_kv=attention.store_kv, prefill_attention=attention.prefill_attention,
                     decode_attention=attention.decode_attention, rms_norm=fused.rms_norm,
                     add_rms_norm=fused.add_rms_norm, qk_norm_rope=fused.qk_norm_rope,
                     qk_norm_rope_store=fused.qk_norm_rope_store, silu_and_mul=fused.silu_and_mul, linear=linear,
                     silu_mul_linear=silu_mul_linear, linear_add_rms_norm=linear_add_rms_norm,
                     norm_linear=norm_linear, norm_linear_normed=norm_linear_normed, capturable=capturable,
                     prologue_norm_max_tokens=prologue_norm_max_tokens,
                     warm_up_attention=getattr(attention, "warm_up_attention", KernelOps.warm_up_attention))


def _torch_silu_mul_linear(x, weight):
    return F.linear(fused_ref.silu_and_mul(x), weight)


def _torch_linear_add_rms_norm(x, weight, residual, norm_weight, eps, *, gated=False):
    y = _torch_silu_mul_linear(x, weight) if gated else F.linear(x, weight)
    return fused_ref.add_rms_norm(y, residual, norm_weight, eps)


def _torch_norm_rows(x, residual, norm_weight, eps):
    if residual is None:
        return fused_ref.rms_norm(x, norm_weight, eps), x
    return fused_ref.add_rms_norm(x, residual, norm_weight, eps)


def _torch_norm_linear(x, residual, norm_weight, eps, weight, *, gated=False):
    normed, summed = _torch_norm_rows(x, residual, norm_weight, eps)
    y = F.linear(normed, weight)
    return (fused_ref.silu_and_mul(y) if gated else y), summed


def _torch_norm_linear_normed(x, residual, norm_weight, eps, weight):
    normed, summed = _torch_norm_rows(x, residual, norm_weight, eps)
    return F.linear(normed, weight), normed, summed


def get_kernel_ops(device: torch.device | str, prefer: str = "auto",
                   options: Optional[KernelOptions] = None) -> KernelOps:
    """prefer: "auto" (Triton on CUDA, torch elsewhere), "torch" or "triton". `options`: the rank's kernel options
    (None: the defaults); the torch backend has nothing to bind."""
    dev = torch.device(device)
    options = options if options is not None else KernelOptions()
    if prefer not in ("auto", "torch", "triton"):
        raise ValueError(f"unknown kernel backend {prefer!r}; use auto, torch or triton")
    if prefer == "torch" or (prefer == "auto" and dev.type != "cuda"):
        # The reference ops loop over sequences on the host: usable in graphs only on the full-graph-free paths.
        ops = _collect("torch", attention_ref, fused_ref, F.linear,
                       _torch_silu_mul_linear, _torch_linear_add_rms_norm, _torch_norm_linear,
                       _torch_norm_linear_normed, capturable=False,
                       prologue_norm_max_tokens=0)
        return replace(ops, options=options)
    if dev.type != "cuda":
        raise ValueError("the triton kernel backend needs a CUDA device")
    return _triton_ops(dev, options)


def _triton_ops(dev: torch.device, options: KernelOptions) -> KernelOps:
    from modeling.ops import (triton_attention, triton_fused, triton_gemm, triton_gemm_measure, triton_moe,
                               triton_moe_pairs, triton_router)
    from modeling.ops.pdl import pdl_mode

    pdl, gemv, single = pdl_mode(dev, options.pdl), options.gemv_max_rows(), options.decode_single_launch
    prefetch = options.decode_prefetch
    moe_pdl = pdl if options.moe_pdl else 0
    bind = functools.partial
    measure = (bind(triton_gemm_measure.measure_projection_fallbacks, gemv=gemv, pdl=pdl)
               if options.measure_projections else KernelOps.measure_projections)
    return KernelOps(
        name="triton", store_kv=triton_attention.store_kv, prefill_attention=triton_attention.prefill_attention,
        decode_attention=bind(triton_attention.decode_attention, single_launch=single, prefetch=prefetch, pdl=pdl),
        rms_norm=bind(triton_fused.rms_norm, pdl=pdl), add_rms_norm=bind(triton_fused.add_rms_norm, pdl=pdl),
        qk_norm_rope=triton_fused.qk_norm_rope, qk_norm_rope_store=bind(triton_fused.qk_norm_rope_store, pdl=pdl),
        silu_and_mul=bind(triton_fused.silu_and_mul, pdl=pdl),
        linear=bind(triton_gemm.linear, pdl=pdl, gemv=gemv),
        silu_mul_linear=bind(triton_gemm.silu_mul_linear, pdl=pdl, gemv=gemv),
        linear_add_rms_norm=bind(triton_gemm.linear_add_rms_norm, pdl=pdl, gemv=gemv),
        norm_linear=bind(triton_gemm.norm_linear, pdl=pdl, gemv=gemv),
        norm_linear_normed=bind(triton_gemm.norm_linear_normed, pdl=pdl, gemv=gemv), capturable=True,
        prologue_norm_max_tokens=gemv,
        warm_up_attention=bind(triton_attention.warm_up_attention, threads=options.compile_threads, pdl=pdl,
                               single_launch=single, prefetch=prefetch),
        moe_routed=bind(triton_moe_pairs.routed_experts_by_size, pairs_max=options.moe_pairs_max, pdl=moe_pdl),
        moe_packed=bind(triton_moe.packed_experts, pdl=moe_pdl),
        moe_route=bind(triton_router.route_topk, pdl=pdl) if options.moe_route_kernel else None,
        moe_router_linear=bind(triton_gemm.router_linear, pdl=pdl, gemv=gemv) if options.moe_router_gemv else None,
        measure_projections=measure,
        options=options)
