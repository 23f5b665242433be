"""`KernelOptions`: how a rank's operators launch (PDL, the decode GEMV, the decode attention's combine, compile
threads, the start-up measurement of untuned decode projections). Built once on the driver
(`actors.environment.options_from_environ` reads the `GRAPHLINE_*` variables) and sent to every rank inside
`actors.rank.RuntimeConfig.kernels`; `modeling.ops.get_kernel_ops` binds them into the `KernelOps` a model calls,
so no launch reads an option. Torch- and Triton-free."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

PDL_ENV = "GRAPHLINE_PDL"
GEMV_ENV = "GRAPHLINE_GEMV"
GEMV_ROWS_ENV = "GRAPHLINE_GEMV_ROWS"
DECODE_SINGLE_LAUNCH_ENV = "GRAPHLINE_DECODE_SINGLE_LAUNCH"
DECODE_PREFETCH_ENV = "GRAPHLINE_DECODE_PREFETCH"
COMPILE_THREADS_ENV = "GRAPHLINE_COMPILE_THREADS"
PROJECTION_MEASURE_ENV = "GRAPHLINE_PROJECTION_MEASURE"
MOE_ROUTE_KERNEL_ENV = "GRAPHLINE_MOE_ROUTE_KERNEL"
MOE_PDL_ENV = "GRAPHLINE_MOE_PDL"
MOE_ROUTER_GEMV_ENV = "GRAPHLINE_MOE_ROUTER_GEMV"
MOE_PAIRS_MAX_ENV = "GRAPHLINE_MOE_PAIRS_MAX"
MOE_IN_PIECES_ENV = "GRAPHLINE_MOE_IN_PIECES"
PDL_CHOICES = ("0", "1", "early")
GEMV_ROW_CHOICES = (1, 2, 3, 4)  # the decode GEMV kernel holds up to 4 rows (`triton_gemv`)
# The decode GEMV serves models up to this hidden size. Above it (Qwen3-8B, 14B) its 1- and 2-row steps measured
# slower than the same model's 3-row step through cuBLAS (docs/benchmarks.md, twentieth session).
GEMV_MAX_HIDDEN = 2048
# Rows the GEMV serves when `gemv_rows` is left to the model (None), by the model's hidden size: at 3-4 rows it ran
# Qwen3-0.6B's decode step at 0.90x of cuBLAS / the skinny GEMM, and 1.7B's and 30B-A3B's at 1.03-1.13x
# (docs/benchmarks.md, twenty-fourth session).
GEMV_AUTO_ROWS = ((1024, 4), (GEMV_MAX_HIDDEN, 2))  # (up to this hidden size, rows)
GEMV_UNRESOLVED_ROWS = 2  # `gemv_max_rows()` of options no model resolved (`for_model`) yet


class KernelOptionsError(ValueError):
    """A kernel option (or the variable it came from) has a value outside its choices."""


@dataclass(frozen=True)
class KernelOptions:
    """pdl: programmatic dependent launch on sm_90+ (`modeling.ops.pdl`): "0" off, "1", or "early" (the default).
    gemv: the decode GEMV and the model's norm-first layout with it (`modeling.ops.triton_gemv`), for models up to
    GEMV_MAX_HIDDEN wide (`for_model`; wider ones take cuBLAS or the skinny GEMM there).
    gemv_rows: the most rows (decode tokens of a step) the GEMV serves, 1-4; larger steps take cuBLAS or the skinny
    GEMM with the norm in their epilogue. None (the default): by the model's width (`for_model`, GEMV_AUTO_ROWS).
    `gemv_max_rows()` is what the kernels are bound with.
    decode_single_launch: split-KV decode attention combines its splits in the split kernel (False: two launches).
    decode_prefetch: whether the split-KV decode attention loads its first KV tile (and the lengths and block-table
    entries) before its PDL wait, overlapping the kernels ahead of it (`modeling.ops.triton_decode`). None (the
    default): the launch config's choice (`DecodeConfig.prefetch`: one-sequence steps); True / False: always / never.
    compile_threads: threads compiling Triton variants at start-up; None: up to 8 of the rank's host cores.
    measure_projections: at warm-up, time cuBLAS against the safe skinny-GEMM config for every decode projection
    shape the tuning table lacks and keep the faster, cached on disk (`modeling.ops.projection_choice`); False:
    neither measure nor read the cache, untuned shapes take the safe config.
    moe_route_kernel: MoE routing (softmax, top-k, renormalisation) in one Triton launch (`triton_router`) instead of
    torch's five kernels (the default; its teacher-forced agreement equals torch routing's over six prompt seeds,
    `bench.moe_router_agreement`, docs/benchmarks.md, twentieth session).
    moe_pdl: the routed-expert kernels (`triton_moe`: grouping, grouped GEMMs, combine) launch with the `pdl` mode
    (the default) instead of without PDL: same bits, only launches overlap.
    moe_router_gemv: the MoE router's projection takes the decode GEMV where it serves (up to `gemv_max_rows()`
    rows; its weights stream before the PDL wait) instead of cuBLAS (the default; other row counts take cuBLAS
    either way); in the norm-first layout it also carries the post-attention residual add + RMSNorm in its prologue
    and keeps the normed rows for the experts (`KernelOps.norm_linear_normed`), one launch fewer a MoE layer.
    moe_pairs_max: up to this many (token, expert) pairs a step (tokens x top-k) the routed experts run pair by pair
    (`triton_moe_pairs`: two launches, no grouping, the combine in the down GEMM; the same bits) instead of the
    grouped kernels' four; 0: never.
    moe_in_pieces: under piecewise prefill graphs, capture a MoE block's routing and experts inside the graph pieces
    where the routed-expert kernel serves them without an EP dispatcher (the default: the same bits, fewer host
    launches; `bench.prefill_ab`), instead of running them as an eager boundary between pieces (False)."""

    pdl: str = "early"
    gemv: bool = True
    gemv_rows: Optional[int] = None
    decode_single_launch: bool = True
    decode_prefetch: Optional[bool] = None
    compile_threads: Optional[int] = None
    measure_projections: bool = True
    moe_route_kernel: bool = True
    moe_pdl: bool = True
    moe_router_gemv: bool = True
    moe_pairs_max: int = 16
    moe_in_pieces: bool = True

    def for_model(self, hidden_size: int) -> "KernelOptions":
        """The options a model of `hidden_size` runs with: the decode GEMV only up to GEMV_MAX_HIDDEN, serving the
        rows GEMV_AUTO_ROWS gives for that width unless `gemv_rows` says."""
        if self.gemv and hidden_size > GEMV_MAX_HIDDEN:
            return dataclasses.replace(self, gemv=False)
        if self.gemv and self.gemv_rows is None:
            rows = next(r for width, r in GEMV_AUTO_ROWS if hidden_size <= width)
            return dataclasses.replace(self, gemv_rows=rows)
        return self

    def gemv_max_rows(self) -> int:
        """Rows up to which the decode GEMV serves a projection: `gemv_rows` (GEMV_UNRESOLVED_ROWS while None), or
        0 with the GEMV off."""
        if not self.gemv:
            return 0
        return GEMV_UNRESOLVED_ROWS if self.gemv_rows is None else self.gemv_rows

    def __post_init__(self) -> None:
        rows = self.gemv_rows
        if rows is not None and (isinstance(rows, bool) or rows not in GEMV_ROW_CHOICES):
            raise KernelOptionsError(f"{GEMV_ROWS_ENV}={self.gemv_rows!r}: use one of "
                                     f"{', '.join(map(str, GEMV_ROW_CHOICES))} (rows the decode GEMV serves)")
        if self.pdl not in PDL_CHOICES:
            raise KernelOptionsError(f"{PDL_ENV}={self.pdl!r}: use 0 (off), 1 (trigger after the wait) or early "
                                     "(the default)")
        for name, env in (("gemv", GEMV_ENV), ("decode_single_launch", DECODE_SINGLE_LAUNCH_ENV),
                          ("measure_projections", PROJECTION_MEASURE_ENV),
                          ("moe_route_kernel", MOE_ROUTE_KERNEL_ENV), ("moe_pdl", MOE_PDL_ENV),
                          ("moe_router_gemv", MOE_ROUTER_GEMV_ENV), ("moe_in_pieces", MOE_IN_PIECES_ENV)):
            if not isinstance(getattr(self, name), bool):
                raise KernelOptionsError(f"{name} ({env}) must be a bool, got {getattr(self, name)!r}")
        if self.decode_prefetch is not None and not isinstance(self.decode_prefetch, bool):
            raise KernelOptionsError(f"decode_prefetch ({DECODE_PREFETCH_ENV}) must be None or a bool, got "
                                     f"{self.decode_prefetch!r}")
        pairs = self.moe_pairs_max
        if isinstance(pairs, bool) or not isinstance(pairs, int) or pairs < 0:
            raise KernelOptionsError(f"{MOE_PAIRS_MAX_ENV}={pairs!r} must be an integer >= 0 (0: the grouped "
                                     "kernels at every size)")
        n = self.compile_threads
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise KernelOptionsError(f"{COMPILE_THREADS_ENV}={n!r} must be an integer >= 1")
