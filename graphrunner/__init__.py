"""graphline's per-rank CUDA graph runner: full decode graphs, piecewise prefill plans, eager fallback.

Model- and operator-blind; imports torch only. See graphrunner/README.md.
"""
from .boundary import OutputPolicy, eager_boundary
from .config import GraphRunnerConfig
from .errors import GraphRunnerConfigError, GraphRunnerError
from .runner import CUDAGraphRunner
from .stats import EagerReason, ExecPath, RunnerStats
from .step import ForwardStep, GraphMeta

__all__ = [
    "CUDAGraphRunner",
    "EagerReason",
    "ExecPath",
    "ForwardStep",
    "GraphMeta",
    "GraphRunnerConfig",
    "GraphRunnerConfigError",
    "GraphRunnerError",
    "OutputPolicy",
    "RunnerStats",
    "eager_boundary",
]
