"""The one reader of the process environment in product code (a CI test, tests/unit/test_layering.py, keeps it so).

Options: `options_from_environ` turns the `GRAPHLINE_*` variables into the typed, frozen option objects
(`KernelOptions`, `CommOptions`, `DriverOptions`), once, on the driver: `launch/options.py` puts them into the
`RuntimeConfig` / `DeploymentConfig` every rank receives, so no rank and no hot path reads a variable.
Library use (tests, benchmarks, an embedding program) builds options directly: a `Coordinator` or `RankRuntime`
given no options runs with their defaults and never looks here.

It lives in `actors/`, not `launch/`, because two process facts must still be read where they are true, and
`actors` is the lowest package that both they and `launch/` may import: a rank's visible GPUs (Ray sets
`CUDA_VISIBLE_DEVICES` per process) and the `PYTHONPATH` a local Ray cluster's workers inherit. `launch/` reads its
own variables (`GRAPHLINE_LOG_DIR`, `GRAPHLINE_ADMIN_TOKEN`, Ray's switches, a child command's environment)
through the named functions below as well.
"""
from __future__ import annotations

import os
from typing import Mapping, MutableMapping, NamedTuple, Optional

from actors.options import DRIVER_POLL_ENV, STEP_PATH_ENV, STEP_PROFILE_ENV, STEP_TRACE_ENV, DriverOptions
from modeling.ops.options import (COMPILE_THREADS_ENV, DECODE_PREFETCH_ENV, DECODE_SINGLE_LAUNCH_ENV, GEMV_ENV,
                                  GEMV_ROWS_ENV, PDL_ENV, PROJECTION_MEASURE_ENV, MOE_IN_PIECES_ENV, MOE_PAIRS_MAX_ENV,
                                  MOE_PDL_ENV, MOE_ROUTE_KERNEL_ENV, MOE_ROUTER_GEMV_ENV, KernelOptions)
from parallel.options import (DEEPEP_MAX_TOKENS_ENV, TP_ALLREDUCE_ENV, TP_FUSED_KIND_ENV, TP_FUSED_NORM_ENV,
                              CommOptions)

LOG_DIR_ENV = "GRAPHLINE_LOG_DIR"
ADMIN_TOKEN_ENV = "GRAPHLINE_ADMIN_TOKEN"
API_KEY_ENV = "GRAPHLINE_API_KEY"


OPTION_VARIABLES = (PDL_ENV, GEMV_ENV, GEMV_ROWS_ENV, DECODE_SINGLE_LAUNCH_ENV, DECODE_PREFETCH_ENV,
                    COMPILE_THREADS_ENV, PROJECTION_MEASURE_ENV, MOE_ROUTE_KERNEL_ENV, MOE_PDL_ENV, MOE_ROUTER_GEMV_ENV,
                    MOE_PAIRS_MAX_ENV, MOE_IN_PIECES_ENV, TP_ALLREDUCE_ENV, TP_FUSED_KIND_ENV, TP_FUSED_NORM_ENV,
                    DEEPEP_MAX_TOKENS_ENV, STEP_PATH_ENV, DRIVER_POLL_ENV, STEP_TRACE_ENV, STEP_PROFILE_ENV)


class EnvironmentValueError(ValueError):
    """A variable's text is not a value of its type (the option classes check the values themselves)."""


class EnvironmentOptions(NamedTuple):
    kernels: KernelOptions
    comm: CommOptions
    driver: DriverOptions


def _flag(environ: Mapping[str, str], name: str, default: Optional[bool], on: str, off: str) -> Optional[bool]:
    raw = environ.get(name)
    if raw is None:
        return default
    value = raw.strip()
    if value not in ("0", "1"):
        raise EnvironmentValueError(f"{name}={value!r}: use 1 ({on}) or 0 ({off})")
    return value == "1"


def _int(environ: Mapping[str, str], name: str) -> Optional[int]:
    raw = environ.get(name)
    if raw is None:
        return None
    try:
        return int(raw)
    except ValueError:
        raise EnvironmentValueError(f"{name}={raw!r} is not an integer") from None


def _text(environ: Mapping[str, str], name: str) -> Optional[str]:
    return environ.get(name) or None  # unset and empty mean the same: no override


def options_from_environ(environ: Mapping[str, str] = os.environ) -> EnvironmentOptions:
    """(kernels, comm, driver) options from `environ`'s `GRAPHLINE_*` variables; unset ones take the defaults.
    A bad value raises a ValueError naming the variable and its choices."""
    threads = _int(environ, COMPILE_THREADS_ENV)
    gemv_rows = _int(environ, GEMV_ROWS_ENV)
    pairs_max = _int(environ, MOE_PAIRS_MAX_ENV)
    kernels = KernelOptions(
        pdl=environ.get(PDL_ENV, KernelOptions.pdl),
        gemv=_flag(environ, GEMV_ENV, True, "the decode GEMV, the default", "off"),
        gemv_rows=gemv_rows,
        decode_single_launch=_flag(environ, DECODE_SINGLE_LAUNCH_ENV, True, "one launch, the default",
                                   "split-KV decode attention in two launches"),
        decode_prefetch=_flag(environ, DECODE_PREFETCH_ENV, None, "decode attention loads its first KV tile before "
                              "its PDL wait", "after it"),
        compile_threads=threads,
        measure_projections=_flag(environ, PROJECTION_MEASURE_ENV, True, "measure untuned projection shapes at "
                                  "start-up, the default", "the safe config for them"),
        moe_route_kernel=_flag(environ, MOE_ROUTE_KERNEL_ENV, True, "route MoE tokens in one Triton launch, the "
                               "default", "torch's routing"),
        moe_pdl=_flag(environ, MOE_PDL_ENV, True, "routed-expert kernels launch with PDL, the default", "without"),
        moe_router_gemv=_flag(environ, MOE_ROUTER_GEMV_ENV, True, "the MoE router projection on the decode GEMV "
                              "where it serves, the default", "cuBLAS"),
        moe_pairs_max=KernelOptions.moe_pairs_max if pairs_max is None else pairs_max,
        moe_in_pieces=_flag(environ, MOE_IN_PIECES_ENV, True, "MoE experts captured inside piecewise graph pieces, "
                            "the default", "an eager boundary between pieces"))
    cap = _int(environ, DEEPEP_MAX_TOKENS_ENV)
    comm = CommOptions(
        tp_allreduce=environ.get(TP_ALLREDUCE_ENV, "").strip().lower() or CommOptions.tp_allreduce,
        tp_fused_kind=environ.get(TP_FUSED_KIND_ENV, CommOptions.tp_fused_kind),
        tp_fused_norm=_flag(environ, TP_FUSED_NORM_ENV, True, "fuse the add + RMSNorm, the default", "never"),
        deepep_max_tokens_per_rank=CommOptions.deepep_max_tokens_per_rank if cap is None else cap)
    poll = _text(environ, DRIVER_POLL_ENV)
    try:
        poll_s = None if poll is None else float(poll)
    except ValueError:
        raise EnvironmentValueError(f"{DRIVER_POLL_ENV}={poll!r} is not a number of seconds") from None
    driver = DriverOptions(step_path=_text(environ, STEP_PATH_ENV), poll_s=poll_s,
                           step_trace=_flag(environ, STEP_TRACE_ENV, False, "trace every step", "off, the default"),
                           step_profile=_text(environ, STEP_PROFILE_ENV))
    return EnvironmentOptions(kernels, comm, driver)


# ---- process facts and launch's own variables

def visible_gpu_ids(environ: Mapping[str, str] = os.environ) -> Optional[list[str]]:
    """The GPU ids this process sees, in `CUDA_VISIBLE_DEVICES` order, when Ray was told not to narrow them
    (`RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1`, set for TP ranks by `actors.startup`); None otherwise (Ray's
    per-actor isolation: the actor's GPU is device 0)."""
    if environ.get("RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES") != "1":
        return None
    return [v.strip() for v in environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]


def python_path(first: str, environ: Mapping[str, str] = os.environ) -> str:
    """`first`, then this process's `PYTHONPATH`: what the workers of a Ray cluster started here import from."""
    return os.pathsep.join(p for p in (first, environ.get("PYTHONPATH")) if p)


def log_dir(environ: Mapping[str, str] = os.environ) -> Optional[str]:
    """`GRAPHLINE_LOG_DIR` (where a failed command's traceback goes), or None."""
    return _text(environ, LOG_DIR_ENV)


def admin_token(environ: Mapping[str, str] = os.environ) -> Optional[str]:
    """`GRAPHLINE_ADMIN_TOKEN` as set (empty included), or None when unset."""
    return environ.get(ADMIN_TOKEN_ENV)


def api_key(environ: Mapping[str, str] = os.environ) -> Optional[str]:
    """`GRAPHLINE_API_KEY` as set (empty included), or None when unset."""
    return environ.get(API_KEY_ENV)


def child_environ(**extra: str) -> dict[str, str]:
    """This process's environment with `extra` on top: for a child command (`graphline bench` starting a server)."""
    return {**os.environ, **extra}


def prepare_ray_process(loopback: bool, environ: MutableMapping[str, str] = os.environ) -> None:
    """Ray's switches, set before Ray is imported: no usage reporting (unless the user chose), and with `loopback`
    every server of a Ray cluster this process starts binds to 127.0.0.1 (Ray reads the variable at import)."""
    environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if loopback:
        environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
