"""The standard-decoder piecewise runtime: descriptor selection, graph inputs, frame inputs, build and replay.

Graph inputs: `input_ids`, `position_ids` (token axis 0) and optional
`mrope_position_ids` (`[3, T]`, token axis 1). Each plan owns static buffers of
its token bucket; at every replay the tail is zeroed, then the real prefix copied.

Frame inputs: `kv_caches`, `attn_metadata`, `state_ids`: the named lookup table of
the live request, re-bound by identity to eager boundary arguments. It does not
make captured use of these values safe: `kv_caches` arenas are runner-lifetime
(reset before they change); `attn_metadata` and `state_ids` are request-lifetime
and may only be consumed by eager boundaries.

Descriptor = (token bucket, graph-visible input names, immutable scalar constants).
The request count is deliberately NOT part of it: every consumer of the request
layout (attention + KV store, MoE routing / EP dispatch, host control flow) must be
an eager boundary; captured work may depend only on the flat token bucket. A model
that captures a batch-shaped operator must add that fact to the descriptor or move
the operator into a boundary.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence, Union

import torch
from torch.profiler import record_function

from .buckets import round_up_tokens
from .errors import GraphCaptureError
from .forward_args import model_kwargs, scalar_constants
from .piecewise import PiecewiseGraphManager
from .stats import EagerReason
from .step import ForwardStep

GRAPH_INPUT_TOKEN_AXES: dict[str, int] = {"input_ids": 0, "position_ids": 0, "mrope_position_ids": 1}
FRAME_INPUT_NAMES: tuple[str, ...] = ("kv_caches", "attn_metadata", "state_ids")
REQUEST_LIFETIME_FRAME_NAMES: tuple[str, ...] = ("attn_metadata", "state_ids")


@dataclass(frozen=True)
class StandardGraphDescriptor:
    """Identifies one complete plan. Hashable; the request count is deliberately absent."""

    token_bucket: int
    graph_input_names: tuple[str, ...] = ("input_ids", "position_ids")
    constants: tuple[tuple[str, Any], ...] = ()


def select_descriptor(step: ForwardStep, token_buckets: Sequence[int]) -> Union[StandardGraphDescriptor, EagerReason]:
    """The descriptor a step replays, or the eager reason; decided before any side effect.

    Order: chunked prefill, micro-batch, live adapter, dynamic extras, empty, too many tokens.
    `step.token_bucket_hint` raises the bucket (DP ranks agree on one bucket).
    """
    if step.chunked_prefill:
        return EagerReason.CHUNKED_PREFILL
    if step.micro_batch:
        return EagerReason.MICRO_BATCH
    if step.adapter_ids is not None:
        return EagerReason.LIVE_ADAPTER
    constants = scalar_constants(step.extras)
    if constants is None:
        return EagerReason.DYNAMIC_EXTRAS
    n = step.num_tokens
    if n < 1:
        return EagerReason.EMPTY_STEP
    want = max(n, int(step.token_bucket_hint or 0))
    if not token_buckets or want > token_buckets[-1]:
        return EagerReason.TOO_MANY_TOKENS
    names = ("input_ids", "position_ids")
    if step.mrope_position_ids is not None:
        names = names + ("mrope_position_ids",)
    return StandardGraphDescriptor(round_up_tokens(want, token_buckets), names, constants)


def frame_inputs(step: ForwardStep) -> dict[str, Any]:
    """The live request frame (name -> value) that eager steps re-bind by name."""
    return {"kv_caches": step.kv_caches, "attn_metadata": step.attn_metadata, "state_ids": step.state_ids}


def _fill_bucket(buf: torch.Tensor, src: torch.Tensor, axis: int) -> None:
    """Zero the padding tail of `buf` along `axis`, then copy the real prefix `src`."""
    n, cap = src.shape[axis], buf.shape[axis]
    if n > cap:
        raise ValueError(f"{n} tokens do not fit a graph input of {cap}")
    if n < cap:
        buf.narrow(axis, n, cap - n).zero_()
    buf.narrow(axis, 0, n).copy_(src, non_blocking=True)


class StandardPiecewiseRuntime:
    """Connects a standard decoder (`model(input_ids, position_ids, kv_caches, attn_metadata, **constants)`)
    to a `PiecewiseGraphManager`. Model-blind beyond that contract and `model.get_outputs`."""

    def __init__(self, model: Any, manager: PiecewiseGraphManager, token_buckets: Sequence[int]):
        self.model = model
        self.manager = manager
        self.token_buckets = tuple(token_buckets)

    def select(self, step: ForwardStep) -> Union[StandardGraphDescriptor, EagerReason]:
        return select_descriptor(step, self.token_buckets)

    def has_plan(self, descriptor: StandardGraphDescriptor) -> bool:
        return self.manager.has_plan(descriptor)

    def _static_inputs(self, descriptor: StandardGraphDescriptor, step: ForwardStep) -> dict[str, torch.Tensor]:
        inputs = {}
        for name in descriptor.graph_input_names:
            src: torch.Tensor = getattr(step, name)
            axis = GRAPH_INPUT_TOKEN_AXES[name]
            shape = list(src.shape)
            shape[axis] = descriptor.token_bucket
            buf = torch.zeros(shape, dtype=src.dtype, device=self.manager.device)
            _fill_bucket(buf, src, axis)
            inputs[name] = buf
        return inputs

    def _kwargs(self, descriptor: StandardGraphDescriptor, step: ForwardStep, inputs: dict) -> dict[str, Any]:
        kwargs = model_kwargs(
            step, inputs["input_ids"], inputs["position_ids"], inputs.get("mrope_position_ids")
        )
        kwargs.update(dict(descriptor.constants))
        return kwargs

    def prepare(self, descriptor: StandardGraphDescriptor, step: ForwardStep) -> torch.Tensor:
        """Start-up only: bucket-shaped eager warm-up, then build and publish the plan.

        `step` is the harmless start-up dummy. Returns the build's own output, sliced
        to the step's tokens (the fresh plan is not replayed again for this call).
        """
        if step.num_tokens > descriptor.token_bucket:
            raise GraphCaptureError(f"{step.num_tokens} tokens do not fit bucket {descriptor.token_bucket}")
        inputs = self._static_inputs(descriptor, step)
        kwargs = self._kwargs(descriptor, step, inputs)
        self.model(**kwargs)  # warm-up: lazy kernel init / autotune must not happen during capture
        out = self.manager.prepare(
            descriptor,
            lambda: self.model(**kwargs),
            frame_inputs(step),
            descriptor.token_bucket,
            inputs,
        )
        return self.model.get_outputs(out, step.num_tokens)

    def replay(self, descriptor: StandardGraphDescriptor, step: ForwardStep) -> torch.Tensor:
        """Bind graph inputs, replay the plan with the live frame, return the real-token view."""
        with record_function("forward_piecewise_cudagraph"):
            plan = self.manager.plan(descriptor)
            for name, buf in plan.inputs.items():
                _fill_bucket(buf, getattr(step, name), GRAPH_INPUT_TOKEN_AXES[name])
            out = plan.replay(frame_inputs(step))
            return self.model.get_outputs(out, step.num_tokens)

    def reset(self) -> None:
        self.manager.reset()
