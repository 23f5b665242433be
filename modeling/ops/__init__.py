"""Operators behind one interface, picked by device: the torch reference (CPU and GPU)
and Triton CUDA kernels (GPU). `get_attention_ops(device, prefer)` returns an
`AttentionOps` whose three functions have identical signatures in both backends."""
from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Callable

import torch

from modeling.ops import attention_ref


@dataclass(frozen=True)
class AttentionOps:
    """name: "torch" or "triton". store_kv / prefill_attention / decode_attention: see attention_ref."""

    name: str
    store_kv: Callable
    prefill_attention: Callable
    decode_attention: Callable
    capturable: bool  # decode + store have static grids and no host sync


def _from_module(name: str, mod: types.ModuleType, capturable: bool) -> AttentionOps:
    return AttentionOps(name, mod.store_kv, mod.prefill_attention, mod.decode_attention, capturable)


def get_attention_ops(device: torch.device | str, prefer: str = "auto") -> AttentionOps:
    """prefer: "auto" (Triton on CUDA, torch elsewhere), "torch" or "triton"."""
    dev = torch.device(device)
    if prefer not in ("auto", "torch", "triton"):
        raise ValueError(f"unknown attention backend {prefer!r}; use auto, torch or triton")
    if prefer == "torch" or (prefer == "auto" and dev.type != "cuda"):
        return _from_module("torch", attention_ref, capturable=False)
    if dev.type != "cuda":
        raise ValueError("the triton attention backend needs a CUDA device")
    from modeling.ops import triton_attention

    return _from_module("triton", triton_attention, capturable=True)
