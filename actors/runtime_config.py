"""`RuntimeConfig`: what every rank of a deployment is built from (frozen, validated, sent to every rank), and the
rank's device (`resolve_device`)."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

from graphrunner.config import GraphRunnerConfig
from modeling.config import ModelConfig, PRESETS, get_preset, load_config
from modeling.ops.options import KernelOptions

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class RuntimeConfig:
    """What every rank of a deployment is built from.

    model: a preset name (random weights, `seed`) or an HF checkpoint directory.
    dtype: override the model dtype ("float32" / "float16" / "bfloat16"); None keeps it
        (presets on CPU run in float32).
    num_kv_blocks: blocks per rank; None sizes from `kv_cache_memory_fraction` of the free
        device memory after weights (CUDA) or uses 512 (CPU).
    max_model_len: longest sequence (prompt + output); sets the block-table width.
    head_graph_max_batch: decode buckets up to this size also capture the LM head as decode epilogues of the
        graph runner: greedy tokens alone, fp32 logits + argmax, and the captured sampler variants (their memory
        is in the decode graphs' pool; `stats()["head_graphs"]["pool_bytes"]`); larger buckets run the head and
        the sampler eagerly; 0 = off.
    kernels: how the rank's operators launch (`modeling.ops.options.KernelOptions`: PDL, GEMV, decode combine,
        compile threads); built on the driver (`actors.environment.options_from_environ`), defaults here.
    armed_decode_wait_ms: how long an armed decode step (`actors.armed`: the next decode step, greedy or
        sampled by a captured sampler head, enqueued behind a gate while the rank waits for its request) waits
        before it gives up (TP > 1: before the driver disarms it); 0 = never arm. Only CUDA ranks with
        expert-parallel size 1 arm.
    sampler_warm_up: launch the eager sampler once per variant class at start-up (CUDA ranks;
        `modeling.sampler.warm_up`), so that no request compiles a sampler kernel mid-serving.
    split_mixed_steps: a chunked-prefill step (decode rows first, then prompt chunks) runs as its decode rows'
        decode step (full decode graph) then its prefill rows' step (`actors.mixed_split`; CUDA ranks whose
        DP groups decide their phase alone, steps without sampler extras); False: one step on the token
        bucket's piecewise plan.
    """

    model: str = "qwen3-tiny"
    seed: int = 0
    dtype: Optional[str] = None
    device: str = "auto"
    block_size: int = 64
    num_kv_blocks: Optional[int] = None
    kv_cache_memory_fraction: float = 0.5
    max_model_len: int = 4096
    kernel_backend: str = "auto"
    graph: GraphRunnerConfig = field(default_factory=GraphRunnerConfig)
    head_graph_max_batch: int = 64
    armed_decode_wait_ms: float = 20.0
    kernels: KernelOptions = KernelOptions()
    sampler_warm_up: bool = True
    split_mixed_steps: bool = True

    def __post_init__(self) -> None:
        if self.dtype is not None and self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")
        if self.block_size <= 0 or self.max_model_len <= 0:
            raise ValueError("block_size and max_model_len must be positive")
        if not 0.0 <= self.armed_decode_wait_ms <= 10_000.0:
            raise ValueError(f"armed_decode_wait_ms must be in [0, 10000], got {self.armed_decode_wait_ms}")
        if self.head_graph_max_batch < 0:
            raise ValueError(f"head_graph_max_batch must be >= 0, got {self.head_graph_max_batch}")
        if not 0.0 < self.kv_cache_memory_fraction <= 0.95:
            raise ValueError(f"kv_cache_memory_fraction must be in (0, 0.95], got {self.kv_cache_memory_fraction}")
        if self.model not in PRESETS and not Path(self.model).is_dir():
            get_preset(self.model)  # raises UnknownPresetError naming the known presets

    @property
    def max_blocks_per_seq(self) -> int:
        return -(-self.max_model_len // self.block_size)

    def model_config(self, device: torch.device) -> ModelConfig:
        cfg = get_preset(self.model) if self.model in PRESETS else load_config(self.model)
        if self.dtype is not None:
            cfg = cfg.with_dtype(_DTYPES[self.dtype])
        elif device.type == "cpu" and cfg.dtype != torch.float32:
            cfg = cfg.with_dtype(torch.float32)
        return cfg


class DeviceError(ValueError):
    """The requested device does not exist in this process."""


def resolve_device(spec: str, local_gpu: int = 0) -> torch.device:
    """The rank's device for `spec` ("auto", "cpu", "cuda" or "cuda:N"): "auto" and "cuda" take CUDA device
    `local_gpu` (the rank's own GPU: 0 under Ray's per-actor isolation), so process groups and kernels always see
    an indexed device. Raises DeviceError for CUDA when torch sees no CUDA device."""
    if spec == "auto":
        return torch.device("cuda", local_gpu) if torch.cuda.is_available() else torch.device("cpu")
    dev = torch.device(spec)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise DeviceError(f"device {spec!r}: torch sees no CUDA device (a CPU build of torch, no driver, or "
                              "CUDA_VISIBLE_DEVICES hides them); use --device cpu or auto")
        if dev.index is None:
            dev = torch.device("cuda", local_gpu)
    return dev
