"""`@eager_boundary`: how an operator declares request-dependent work.

Outside piecewise plan construction the decorator is transparent: the wrapper
looks up the active builder of this thread (a context variable that is set only
while `_CaptureBuilder.build` runs) and, finding none, calls the function. So the
same decorated operator runs eagerly, inside full decode graphs (captured whole),
and at piecewise replay (where the plan calls the undecorated function directly).

During construction the outermost boundary ends the current graph piece, runs
the function eagerly on real data and binds its result; boundaries called from
inside it (nested) are plain calls that belong to the outermost one.
"""
from __future__ import annotations

import contextvars
import enum
import functools
from dataclasses import dataclass
from typing import Any, Callable, Optional, TypeVar, overload

from .errors import BoundaryDeclarationError

F = TypeVar("F", bound=Callable[..., Any])


class OutputPolicy(enum.Enum):
    """How a boundary result reaches the rest of the plan (exactly one per boundary).

    BRIDGE: fixed graph-visible tensor(s); the result is copied into a stable bridge of
        the same shape/dtype/layout (dense tensors that own their storage only).
    PADDED_TOKENS: raw-token result; along `token_axis` it may have FEWER rows (real
        tokens) than the bucket; copied into a bucket-length bridge whose tail is zeroed.
    PADDED_VIEW: like PADDED_TOKENS but view-tolerant: the result may be a (strided,
        partial) view into operator-owned storage, e.g. a DeepEP combine buffer.
    EAGER_ONLY: consumed only by later eager boundaries; kept in a per-replay slot and
        never visible to captured work.
    """

    BRIDGE = "bridge"
    PADDED_TOKENS = "padded_tokens"
    PADDED_VIEW = "padded_view"
    EAGER_ONLY = "eager_only"


@dataclass(frozen=True)
class BoundarySpec:
    """The declaration of one eager boundary (immutable, shared by every plan)."""

    name: str
    fn: Callable[..., Any]
    output: OutputPolicy = OutputPolicy.BRIDGE
    token_axis: int = 0
    reuse_bridge_after_next_step: bool = False

    @property
    def padded(self) -> bool:
        return self.output in (OutputPolicy.PADDED_TOKENS, OutputPolicy.PADDED_VIEW)


# The builder constructing a plan in this thread/context, or None. Set only inside
# `_CaptureBuilder.build` (start-up), never while serving.
_ACTIVE_BUILDER: contextvars.ContextVar[Optional[Any]] = contextvars.ContextVar("graphrunner_active_builder", default=None)


def active_builder() -> Optional[Any]:
    """The plan builder active in this context (None outside piecewise construction)."""
    return _ACTIVE_BUILDER.get()


def _make_wrapper(fn: Callable[..., Any], spec: BoundarySpec) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        builder = _ACTIVE_BUILDER.get()
        if builder is None:
            return fn(*args, **kwargs)
        return builder.on_boundary(spec, args, kwargs)

    wrapper.__eager_boundary__ = spec  # type: ignore[attr-defined]
    return wrapper


@overload
def eager_boundary(fn: F) -> F: ...


@overload
def eager_boundary(
    fn: None = None,
    *,
    output: OutputPolicy = OutputPolicy.BRIDGE,
    token_axis: int = 0,
    reuse_bridge_after_next_step: bool = False,
) -> Callable[[F], F]: ...


def eager_boundary(
    fn: Optional[Callable[..., Any]] = None,
    *,
    output: OutputPolicy = OutputPolicy.BRIDGE,
    token_axis: int = 0,
    reuse_bridge_after_next_step: bool = False,
) -> Any:
    """Declare `fn` an eager boundary of piecewise CUDA graph plans.

    Usable bare (`@eager_boundary`, policy BRIDGE) or with keywords. Methods of
    nn.Modules may be decorated: the module is then a runner-owned constant argument.
    `reuse_bridge_after_next_step=True` promises the result is dead after the step that
    immediately follows this boundary (its bridge storage may then back later bridges).
    """
    if not isinstance(output, OutputPolicy):
        raise BoundaryDeclarationError(f"output must be an OutputPolicy, got {output!r}")
    if not isinstance(token_axis, int) or isinstance(token_axis, bool):
        raise BoundaryDeclarationError(f"token_axis must be an int, got {token_axis!r}")
    if not isinstance(reuse_bridge_after_next_step, bool):
        raise BoundaryDeclarationError("reuse_bridge_after_next_step must be a bool")
    if reuse_bridge_after_next_step and output is OutputPolicy.EAGER_ONLY:
        raise BoundaryDeclarationError("an EAGER_ONLY result has no bridge to reuse")

    def decorate(f: Callable[..., Any]) -> Callable[..., Any]:
        if not callable(f):
            raise BoundaryDeclarationError(f"eager_boundary needs a callable, got {f!r}")
        if hasattr(f, "__eager_boundary__"):
            raise BoundaryDeclarationError(f"{getattr(f, '__qualname__', f)!r} is already an eager boundary")
        name = f"{getattr(f, '__module__', '?')}.{getattr(f, '__qualname__', repr(f))}"
        spec = BoundarySpec(name, f, output, token_axis, reuse_bridge_after_next_step)
        return _make_wrapper(f, spec)

    if fn is not None:
        return decorate(fn)
    return decorate


def boundary_spec(fn: Callable[..., Any]) -> Optional[BoundarySpec]:
    """The BoundarySpec of a decorated callable, or None."""
    return getattr(fn, "__eager_boundary__", None)
