"""The three-way dispatch decision, as a side-effect-free policy (CPU-testable).

    decode, model supports it, batch <= max, captured  -> full CUDA graph
    otherwise, tokens and sequences within a captured
    full prefill graph the model supports              -> full prefill graph
    token-bucket plan published                          -> piecewise replay
    start-up preparation context, no plan yet            -> build the plan
    everything else                                      -> eager (reason recorded)

A locally decoding step whose full graph is unavailable (or that the coordinator
placed in a global prefill, `global_decode=False`) may still replay the token-bucket
plan: captured pieces depend only on the flat token bucket and the attention
boundary picks the decode kernel from live metadata. If it ends eager, the decode
rejection is the recorded reason.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol, Sequence, Union

from .buckets import round_up_decode
from .forward_args import scalar_constants
from .full_graph import DecodeGraphKey, decode_graph_key
from .prefill_graph import PrefillGraphKey
from .stats import EagerReason
from .step import ForwardStep


class Path(str, enum.Enum):
    FULL_GRAPH = "full_graph"
    PREFILL_GRAPH = "prefill_graph"
    PIECEWISE = "piecewise"
    BUILD = "piecewise_build"
    EAGER = "eager"


@dataclass(frozen=True)
class Decision:
    path: Path
    reason: Optional[EagerReason] = None
    decode_key: Optional[DecodeGraphKey] = None
    descriptor: Optional[Any] = None
    prefill_key: Optional[PrefillGraphKey] = None


class PiecewiseSelector(Protocol):
    def select(self, step: ForwardStep) -> Union[Any, EagerReason]: ...

    def has_plan(self, descriptor: Any) -> bool: ...


class PrefillGraphSelector(Protocol):
    def key_for(self, step: ForwardStep) -> Optional[PrefillGraphKey]: ...

    def has_graph(self, key: PrefillGraphKey) -> bool: ...


class DispatchPolicy:
    """Decides a step's path from static facts and the published graphs; never touches the device.

    cuda: the runner's device is CUDA. decode_buckets: ascending decode buckets.
    has_decode_graph: whether a decode key is captured. piecewise: the standard
    runtime (None when PCG is off, `piecewise_off_reason` says why). prefill_graphs: the full prefill graphs
    (None when off).
    """

    def __init__(
        self,
        *,
        model: Any,
        eager_mode: bool,
        cuda: bool,
        decode_buckets: Sequence[int],
        has_decode_graph: Callable[[DecodeGraphKey], bool],
        piecewise: Optional[PiecewiseSelector],
        piecewise_off_reason: Optional[EagerReason] = None,
        prefill_graphs: Optional[PrefillGraphSelector] = None,
    ):
        self.model = model
        self.eager_mode = eager_mode
        self.cuda = cuda
        self.decode_buckets = tuple(decode_buckets)
        self.has_decode_graph = has_decode_graph
        self.piecewise = piecewise
        self.piecewise_off_reason = piecewise_off_reason or EagerReason.PCG_DISABLED
        self.prefill_graphs = prefill_graphs

    def decide(self, step: ForwardStep, preparing: bool = False) -> Decision:
        if self.eager_mode:
            return Decision(Path.EAGER, EagerReason.EAGER_MODE)
        if not self.cuda:
            return Decision(Path.EAGER, EagerReason.NO_CUDA)
        if step.num_tokens < 1:
            return Decision(Path.EAGER, EagerReason.EMPTY_STEP)
        decode_reason: Optional[EagerReason] = None
        if step.is_decoding and step.global_decode is not False:
            decode_reason, key = self.decode_choice(step)
            if decode_reason is None:
                return Decision(Path.FULL_GRAPH, decode_key=key)
        prefill_key = self.prefill_graph_choice(step)
        if prefill_key is not None:
            return Decision(Path.PREFILL_GRAPH, prefill_key=prefill_key)
        choice = self.piecewise_choice(step, preparing)
        if isinstance(choice, Decision):
            return choice
        return Decision(Path.EAGER, decode_reason or choice)

    def decode_choice(self, step: ForwardStep) -> tuple[Optional[EagerReason], Optional[DecodeGraphKey]]:
        """(None, key) when a captured full graph serves this decode step, else (reason, None)."""
        if step.micro_batch:
            return EagerReason.MICRO_BATCH, None
        if step.adapter_ids is not None:
            return EagerReason.LIVE_ADAPTER, None
        if scalar_constants(step.extras) is None:
            return EagerReason.DYNAMIC_EXTRAS, None
        if not self.decode_buckets:
            return EagerReason.DECODE_GRAPHS_DISABLED, None
        if not self.model.supports_cuda_graph(step):
            return EagerReason.NOT_SUPPORTED_BY_MODEL, None
        want = max(step.batch_size, int(step.batch_bucket_hint or 0))
        if want > self.decode_buckets[-1]:
            return EagerReason.BATCH_TOO_LARGE, None
        key = decode_graph_key(self.model, step, round_up_decode(want, self.decode_buckets))
        if not self.has_decode_graph(key):
            return EagerReason.NOT_CAPTURED, None
        return None, key

    def prefill_graph_choice(self, step: ForwardStep) -> Optional[PrefillGraphKey]:
        """The captured full prefill graph serving `step`, or None (then piecewise or eager decide)."""
        pg = self.prefill_graphs
        if pg is None or step.micro_batch or step.adapter_ids is not None or step.chunked_prefill:
            return None
        if not self.model.supports_prefill_graph(step):
            return None
        key = pg.key_for(step)
        return key if key is not None and pg.has_graph(key) else None

    def piecewise_choice(self, step: ForwardStep, preparing: bool) -> Union[Decision, EagerReason]:
        if self.piecewise is None:
            return self.piecewise_off_reason
        selected = self.piecewise.select(step)
        if isinstance(selected, EagerReason):
            return selected
        if self.piecewise.has_plan(selected):
            return Decision(Path.PIECEWISE, descriptor=selected)
        if preparing:
            return Decision(Path.BUILD, descriptor=selected)
        return EagerReason.NO_PLAN  # serving never captures
