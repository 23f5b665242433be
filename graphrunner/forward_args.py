"""The one place that turns a `ForwardStep` into model keyword arguments (every path uses it)."""
from __future__ import annotations

from typing import Any, Optional

import torch

from .step import ForwardStep

_SCALAR_TYPES = (bool, int, float, str, type(None))


def scalar_constants(extras: Any) -> Optional[tuple[tuple[str, Any], ...]]:
    """Sorted (name, value) pairs when every extra is an immutable scalar; None if any is dynamic."""
    if not extras:
        return ()
    items = []
    for k, v in extras.items():
        if not isinstance(k, str) or not isinstance(v, _SCALAR_TYPES):
            return None
        items.append((k, v))
    return tuple(sorted(items, key=lambda kv: kv[0]))


def model_kwargs(
    step: ForwardStep,
    input_ids: Optional[torch.Tensor] = None,
    position_ids: Optional[torch.Tensor] = None,
    mrope_position_ids: Optional[torch.Tensor] = None,
) -> dict[str, Any]:
    """`model(**model_kwargs(step))`: the four standard arguments, optional ones only when set, plus extras.

    Graph paths pass their static buffers as overrides for the graph inputs.
    """
    kwargs: dict[str, Any] = {
        "input_ids": step.input_ids if input_ids is None else input_ids,
        "position_ids": step.position_ids if position_ids is None else position_ids,
        "kv_caches": step.kv_caches,
        "attn_metadata": step.attn_metadata,
    }
    mrope = step.mrope_position_ids if mrope_position_ids is None else mrope_position_ids
    if mrope is not None:
        kwargs["mrope_position_ids"] = mrope
    if step.state_ids is not None:
        kwargs["state_ids"] = step.state_ids
    if step.adapter_ids is not None:
        kwargs["adapter_ids"] = step.adapter_ids
    if step.extras:
        kwargs.update(step.extras)
    return kwargs
