"""Named exceptions of the graph runner.

Every rejection the runner makes has its own class so callers (rank runtime,
coordinator, tests) can tell configuration bugs, capture failures and
request-time policy apart. Request-time *policy* (a step that cannot use a
graph) is not an exception: it is an eager reason recorded in the stats.
"""
from __future__ import annotations


class GraphRunnerError(RuntimeError):
    """Base class of every error raised by `graphrunner`."""


class GraphRunnerConfigError(GraphRunnerError, ValueError):
    """A `GraphRunnerConfig` (or a bucket override) is invalid."""


class BucketError(GraphRunnerError, ValueError):
    """A size cannot be mapped to a bucket."""


class BatchTooLargeError(BucketError):
    """A decode batch is larger than the largest decode bucket."""


class TooManyTokensError(BucketError):
    """A step has more tokens than the largest piecewise token bucket."""


class GraphCaptureError(GraphRunnerError):
    """Start-up capture was asked for something it cannot do (unknown bucket, bad dummy step)."""


class BoundaryDeclarationError(GraphRunnerError, ValueError):
    """`@eager_boundary` was given an inconsistent declaration."""


class PlanBuildError(GraphRunnerError):
    """A piecewise plan could not be built; nothing was published."""


class ConcurrentBuildError(PlanBuildError):
    """A plan build started while another build is active in this thread."""


class UnsupportedBoundaryOutput(PlanBuildError):
    """An eager boundary returned something its output policy cannot bridge.

    Raised for non-strided or host tensors, outputs aliasing a boundary input,
    mixed trees (tensor and non-tensor leaves under a bridge policy), partial
    views under a non-view-tolerant policy, and token counts above the bucket.
    """


class UnsupportedBoundaryArgument(PlanBuildError):
    """An eager boundary argument cannot be represented in a replay template."""


class NestedRequestObjectError(UnsupportedBoundaryArgument):
    """A request-frame value (or a tensor owned by one) reached a boundary nested inside another object.

    Binding is deliberately shallow: pass `kv_caches`, `attn_metadata` and
    `state_ids` themselves as direct boundary arguments.
    """


class CapturedRequestValueError(PlanBuildError):
    """Captured (graph) work consumed a value whose address is not stable for the plan lifetime.

    Examples: an eager-only boundary result, a tensor of the start-up request's
    attention metadata, or a reusable bridge after its declared last use.
    """


class BridgeMismatchError(GraphRunnerError):
    """At replay an eager boundary returned a value that does not fit its bridge (shape, dtype, rows)."""


class PlanNotFoundError(GraphRunnerError):
    """Replay was asked for a descriptor without a published plan."""
