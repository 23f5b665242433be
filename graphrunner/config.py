"""Graph runner configuration (one per rank; every rank of a group must use the same one)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from .buckets import DEFAULT_TOKEN_STRIDE, _is_int, decode_buckets, prefill_token_buckets, validate_sizes
from .errors import GraphRunnerConfigError

PREFILL_GRAPH_MIN_TOKENS = 16  # the smallest full prefill graph token bucket


@dataclass(frozen=True)
class GraphRunnerConfig:
    """What the runner may capture.

    eager_mode: never capture; every step runs the plain model forward (reason `eager_mode`).
    max_decode_batch: largest decode batch served by a full graph; 0 disables decode graphs.
    decode_capture_sizes: explicit ascending decode buckets (each 1..max_decode_batch)
        replacing the default policy of `buckets.decode_buckets`.
    pcg_max_tokens: largest piecewise (prefill) token bucket; None or 0 disables PCG.
    pcg_token_stride: spacing of piecewise token buckets (seed default 512).
    pcg_min_tokens: optional finer power-of-two token buckets below the stride,
        starting here (e.g. 64 -> 64, 128, 256, 512, 1024, ...). None = off.
    pcg_capture_guard: while building a plan, check that captured work never
        consumes eager-only results, start-up request tensors, or reusable
        bridges after their declared last use (start-up cost only).
    prefill_graph_max_tokens: largest token bucket of the full prefill graphs (`graphrunner.prefill_graph`):
        a whole non-decode step of at most this many tokens and `prefill_graph_max_seqs` sequences, attention
        included, replayed as one CUDA graph from live metadata. 0 = off (steps take the piecewise plans).
    prefill_graph_max_seqs: most sequences such a step may hold (sequence buckets: powers of two up to it).
    """

    eager_mode: bool = False
    max_decode_batch: int = 256
    decode_capture_sizes: Optional[Sequence[int]] = None
    pcg_max_tokens: Optional[int] = 4096
    pcg_token_stride: int = DEFAULT_TOKEN_STRIDE
    pcg_min_tokens: Optional[int] = None
    pcg_capture_guard: bool = True
    prefill_graph_max_tokens: int = 0
    prefill_graph_max_seqs: int = 4

    def __post_init__(self) -> None:
        if not isinstance(self.eager_mode, bool):
            raise GraphRunnerConfigError(f"eager_mode must be a bool, got {self.eager_mode!r}")
        if not isinstance(self.pcg_capture_guard, bool):
            raise GraphRunnerConfigError(f"pcg_capture_guard must be a bool, got {self.pcg_capture_guard!r}")
        if not _is_int(self.max_decode_batch) or self.max_decode_batch < 0:
            raise GraphRunnerConfigError(f"max_decode_batch must be an int >= 0, got {self.max_decode_batch!r}")
        if self.decode_capture_sizes is not None:
            if isinstance(self.decode_capture_sizes, (str, bytes)):
                raise GraphRunnerConfigError("decode_capture_sizes must be a sequence of ints")
            if self.max_decode_batch == 0:
                raise GraphRunnerConfigError("decode_capture_sizes was given but max_decode_batch is 0")
            sizes = validate_sizes(self.decode_capture_sizes, "decode_capture_sizes", self.max_decode_batch)
            object.__setattr__(self, "decode_capture_sizes", sizes)
        if self.pcg_max_tokens is not None and (not _is_int(self.pcg_max_tokens) or self.pcg_max_tokens < 0):
            raise GraphRunnerConfigError(f"pcg_max_tokens must be None or an int >= 0, got {self.pcg_max_tokens!r}")
        if not _is_int(self.pcg_token_stride) or self.pcg_token_stride <= 0:
            raise GraphRunnerConfigError(f"pcg_token_stride must be an int > 0, got {self.pcg_token_stride!r}")
        if self.pcg_min_tokens is not None:
            if not _is_int(self.pcg_min_tokens) or self.pcg_min_tokens < 1:
                raise GraphRunnerConfigError(f"pcg_min_tokens must be None or an int >= 1, got {self.pcg_min_tokens!r}")
            if self.pcg_min_tokens >= self.pcg_token_stride:
                raise GraphRunnerConfigError(
                    f"pcg_min_tokens ({self.pcg_min_tokens}) must be below pcg_token_stride ({self.pcg_token_stride})"
                )

        for name in ("prefill_graph_max_tokens", "prefill_graph_max_seqs"):
            v = getattr(self, name)
            if not _is_int(v) or v < (0 if name == "prefill_graph_max_tokens" else 1):
                raise GraphRunnerConfigError(f"{name} must be an int >= {0 if 'tokens' in name else 1}, got {v!r}")

    @property
    def pcg_enabled(self) -> bool:
        """Piecewise plans are configured (the model and device may still rule them out)."""
        return not self.eager_mode and bool(self.pcg_max_tokens)

    def decode_buckets(self) -> tuple[int, ...]:
        """Ascending decode buckets (() when max_decode_batch is 0).

        Independent of `eager_mode`: an eager rank still warms up the same buckets
        so the start-up lock-step protocol is identical on every rank.
        """
        return decode_buckets(self.max_decode_batch, self.decode_capture_sizes)

    def prefill_buckets(self) -> tuple[int, ...]:
        """Ascending piecewise token buckets (() when pcg_max_tokens is None/0); independent of `eager_mode`."""
        return prefill_token_buckets(self.pcg_max_tokens, self.pcg_token_stride, self.pcg_min_tokens)

    def prefill_graph_buckets(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(ascending token buckets, ascending sequence buckets) of the full prefill graphs; ((), ()) when off.
        Tokens: powers of two from 16 below the piecewise stride, then multiples of the stride, then the maximum
        (`buckets.prefill_token_buckets`); sequences: powers of two up to `prefill_graph_max_seqs`, and it."""
        if not self.prefill_graph_max_tokens:
            return (), ()
        low = PREFILL_GRAPH_MIN_TOKENS if PREFILL_GRAPH_MIN_TOKENS < self.pcg_token_stride else None
        tokens = prefill_token_buckets(self.prefill_graph_max_tokens, self.pcg_token_stride, low)
        seqs = sorted({1 << i for i in range(self.prefill_graph_max_seqs.bit_length())
                       if (1 << i) <= self.prefill_graph_max_seqs} | {self.prefill_graph_max_seqs})
        return tokens, tuple(seqs)
