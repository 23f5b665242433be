"""What every EP dispatcher shares (`parallel.dispatch.AllGatherDispatcher`, `parallel.deepep.DeepEPDispatcher`):
the per-step static token count (see `parallel.dispatch` for when a step is static) and the dispatcher error."""
from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

import torch


class DispatcherError(RuntimeError):
    """A dispatcher was misused (token count above the static size, unknown kind, bad layout)."""


def _capturing(t: torch.Tensor) -> bool:
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


class StaticTokensMixin:
    """The per-step size hint shared by dispatchers (see module doc)."""

    _static_n: Optional[int] = None

    @contextlib.contextmanager
    def static_tokens(self, n: Optional[int]) -> Iterator[None]:
        """Inside: every rank has exactly `n` rows after padding (None = no hint, dynamic)."""
        if n is not None and n < 1:
            raise DispatcherError(f"static token count must be >= 1, got {n}")
        prev, self._static_n = self._static_n, n
        try:
            yield
        finally:
            self._static_n = prev

    def packed_counts(self, handle: Any) -> Optional[torch.Tensor]:
        """Per-expert row counts of a packed dispatch (`parallel.dispatch` module doc); None: rows carry their own
        routing."""
        return None

    def _static_size(self, hidden: torch.Tensor) -> Optional[int]:
        t = int(hidden.shape[0])
        if self._static_n is not None:
            if t > self._static_n:
                raise DispatcherError(f"{t} tokens exceed the step's static token count {self._static_n}")
            return self._static_n
        if _capturing(hidden):
            return t
        return None
