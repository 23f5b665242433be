"""Per-rank runner statistics (plain counters; `snapshot()` is JSON-able for the coordinator and dashboards)."""
from __future__ import annotations

import enum
from typing import Any, Optional


class ExecPath(str, enum.Enum):
    """Which path served a step."""

    FULL_GRAPH = "full_graph"
    PREFILL_GRAPH = "prefill_graph"
    PIECEWISE = "piecewise"
    EAGER = "eager"


CAPTURE_KINDS = ("decode", "prefill", "prefill_graph")


class EagerReason(str, enum.Enum):
    """Why a step ran eager. Every value is decided before any side effect of the step."""

    EAGER_MODE = "eager_mode"  # config.eager_mode
    NO_CUDA = "no_cuda"  # the runner's device is not CUDA
    EMPTY_STEP = "empty_step"  # a step with no tokens
    NOT_SUPPORTED_BY_MODEL = "not_supported_by_model"  # model.supports_cuda_graph(step) is False
    DECODE_GRAPHS_DISABLED = "decode_graphs_disabled"  # max_decode_batch == 0
    BATCH_TOO_LARGE = "batch_too_large"  # decode batch above the largest decode bucket
    NOT_CAPTURED = "not_captured"  # no decode graph for this key (serving never captures)
    CHUNKED_PREFILL = "chunked_prefill"
    MICRO_BATCH = "micro_batch"
    LIVE_ADAPTER = "live_adapter"  # step.adapter_ids is set
    DYNAMIC_EXTRAS = "dynamic_extras"  # a non-scalar extra forward argument
    TOO_MANY_TOKENS = "too_many_tokens"  # above the largest piecewise token bucket
    NO_PLAN = "no_plan"  # no published plan for the descriptor (serving never builds)
    PCG_DISABLED = "pcg_disabled"  # pcg_max_tokens is None/0
    PCG_UNSUPPORTED_BY_MODEL = "pcg_unsupported_by_model"  # model did not opt in / could not install boundaries


class RunnerStats:
    """Counters of one rank's runner. Step counters are cumulative; capture tables and memory
    figures describe the current generation of graphs and are cleared by `on_reset()`."""

    def __init__(self) -> None:
        self.steps: dict[str, int] = {p.value: 0 for p in ExecPath}
        self.eager_reasons: dict[str, int] = {}
        self.real_tokens: dict[str, int] = {p.value: 0 for p in ExecPath}
        self.padded_tokens: dict[str, int] = {p.value: 0 for p in ExecPath}
        self.capture_seconds: dict[str, dict[int, float]] = {k: {} for k in CAPTURE_KINDS}
        self.captured_as_graph: dict[str, dict[int, bool]] = {k: {} for k in CAPTURE_KINDS}
        self.decode_graph_pool_bytes = 0
        self.prefill_graph_pool_bytes = 0
        self.piecewise_graph_pool_bytes = 0
        self.bridge_bytes = 0
        self.static_buffer_bytes = 0
        self.resets = 0

    def record_step(
        self, path: ExecPath, real_tokens: int, padded_tokens: int, reason: Optional[EagerReason] = None
    ) -> None:
        """Count one served step; `padded_tokens` is what the device computed (bucket size)."""
        self.steps[path.value] += 1
        self.real_tokens[path.value] += int(real_tokens)
        self.padded_tokens[path.value] += int(padded_tokens)
        if reason is not None:
            self.eager_reasons[reason.value] = self.eager_reasons.get(reason.value, 0) + 1

    def refresh_memory(self, full: Any, prefill_graphs: Any, piecewise: Any) -> None:
        """Memory figures of the graphs alive now: the decode graphs (`FullGraphRunner`), the full prefill graphs
        (`PrefillGraphRunner`) and the piecewise plans (`PiecewiseGraphManager`), each None when absent."""
        self.decode_graph_pool_bytes = full.pool_bytes if full is not None else 0
        self.static_buffer_bytes = full.buffer_bytes if full is not None else 0
        if prefill_graphs is not None:
            self.prefill_graph_pool_bytes = prefill_graphs.pool_bytes
            self.static_buffer_bytes += prefill_graphs.buffer_bytes
        if piecewise is not None:
            self.piecewise_graph_pool_bytes = piecewise.pool_bytes
            self.bridge_bytes = piecewise.bridge_bytes
            self.static_buffer_bytes += sum(
                b.numel() * b.element_size() for d in piecewise.descriptors() for b in piecewise.plan(d).inputs.values()
            )

    def record_capture(self, kind: str, bucket: int, seconds: float, as_graph: bool) -> None:
        """Record one start-up bucket (`kind`: one of `CAPTURE_KINDS`; "prefill_graph" records every sequence
        bucket of a token bucket as one); `as_graph` False = eager warm-up only."""
        if kind not in self.capture_seconds:
            raise ValueError(f"capture kind must be one of {CAPTURE_KINDS}, got {kind!r}")
        self.capture_seconds[kind][int(bucket)] = float(seconds)
        self.captured_as_graph[kind][int(bucket)] = bool(as_graph)

    def on_reset(self) -> None:
        """Forget the current graph generation (capture tables, memory); keep step counters."""
        self.resets += 1
        self.capture_seconds = {k: {} for k in CAPTURE_KINDS}
        self.captured_as_graph = {k: {} for k in CAPTURE_KINDS}
        self.decode_graph_pool_bytes = 0
        self.prefill_graph_pool_bytes = 0
        self.piecewise_graph_pool_bytes = 0
        self.bridge_bytes = 0
        self.static_buffer_bytes = 0

    def snapshot(self) -> dict[str, Any]:
        """A plain, JSON-serialisable dict (string keys only)."""
        real = sum(self.real_tokens.values())
        padded = sum(self.padded_tokens.values())

        def per_bucket(kind: str) -> dict[str, Any]:
            return {
                str(b): {"seconds": s, "graph": self.captured_as_graph[kind][b]}
                for b, s in sorted(self.capture_seconds[kind].items(), reverse=True)
            }

        n_decode = sum(self.captured_as_graph["decode"].values())
        n_prefill = sum(self.captured_as_graph["prefill"].values())
        n_prefill_graphs = sum(self.captured_as_graph["prefill_graph"].values())
        return {
            "captured_decode": n_decode,  # decode graphs alive now (eager warm-ups not counted)
            "captured_prefill": n_prefill,  # piecewise plans alive now
            "captured_prefill_graphs": n_prefill_graphs,  # token buckets with full prefill graphs alive now
            "steps": dict(self.steps),
            "eager_reasons": dict(sorted(self.eager_reasons.items())),
            "tokens": {
                "real": dict(self.real_tokens),
                "padded": dict(self.padded_tokens),
                "real_total": real,
                "padded_total": padded,
                "padding_waste": (padded - real) / padded if padded else 0.0,
            },
            "capture": {
                "decode": per_bucket("decode"),
                "prefill": per_bucket("prefill"),
                "decode_seconds_total": sum(self.capture_seconds["decode"].values()),
                "prefill_seconds_total": sum(self.capture_seconds["prefill"].values()),
                "prefill_graph": per_bucket("prefill_graph"),
                "prefill_graph_seconds_total": sum(self.capture_seconds["prefill_graph"].values()),
                "decode_graphs": n_decode,
                "prefill_plans": n_prefill,
                "prefill_graphs": n_prefill_graphs,
            },
            "memory": {
                "decode_graph_pool_bytes": self.decode_graph_pool_bytes,
                "piecewise_graph_pool_bytes": self.piecewise_graph_pool_bytes,
                "prefill_graph_pool_bytes": self.prefill_graph_pool_bytes,
                "bridge_bytes": self.bridge_bytes,
                "static_buffer_bytes": self.static_buffer_bytes,
            },
            "resets": self.resets,
        }
