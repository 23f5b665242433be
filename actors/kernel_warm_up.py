"""A rank's attention- and projection-kernel compiles, started before its process groups form (overlapping NCCL
set-up, the symmetric-memory rendezvous and the weight load on a cold Triton cache). Under tensor parallelism it
first compiles, without launching, the fused all-reduce + add + RMSNorm kernel the group set-up probes and the
decode graphs run (`parallel.symm_fused.warm_up_compile`), so that the probe finds it compiled.

Triton specialises a kernel on dtypes, constants, pointer alignment and the divisibility of integer arguments,
not on sizes, so a two-block KV cache of the deployment's layout (`KVCacheSpec.for_model`, this rank's share of
the KV heads) compiles exactly the attention variants `RankRuntime.build_runner` then asks for over the real
cache; one layer's projections of the rank's shapes, uninitialised, compile the decode graphs' projection
variants the same way (`modeling.qwen3.config_projection_warm_up_calls`). Lifetime: one background thread per
rank at start-up, on its own CUDA stream; the worker joins it before `build_runner`. A failure here is logged,
never raised: `build_runner` compiles whatever is still missing and reports its own errors.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any, Optional

import torch

log = logging.getLogger(__name__)


class KernelWarmUp:
    """Compile, in a daemon thread started by the constructor, the kernels of `cfg`'s model for the rank `tp_rank`
    of `tp_size`-way tensor parallelism on `device` (CUDA): the fused TP kernel first (`tp_size > 1`; `wait_fused`
    waits for it), then the attention variants. `cfg`: an `actors.rank.RuntimeConfig` (its `kernels` options
    included); `comm`: the deployment's `parallel.options.CommOptions` (None: the defaults)."""

    def __init__(self, cfg, tp_size: int, device: torch.device, tp_rank: int = 0, comm: Optional[Any] = None):
        self.seconds = 0.0
        self.fused_seconds = 0.0  # of which the fused TP kernel's compile (0 at TP = 1 or when it is not used)
        self.launches = 0
        self.error: Optional[BaseException] = None
        self._fused_done = threading.Event()
        self._comm = comm
        self._thread = threading.Thread(target=self._run, args=(cfg, tp_size, tp_rank, device),
                                        name="kernel-warm-up", daemon=True)
        self._thread.start()

    def _run(self, cfg, tp_size: int, tp_rank: int, device: torch.device) -> None:
        t0 = time.perf_counter()
        try:
            self._compile(cfg, tp_size, tp_rank, device, t0)
        except BaseException as e:  # noqa: BLE001 - build_runner compiles what is missing and raises there
            self.error = e
            log.warning("early kernel warm-up failed (the rank compiles on demand instead): %s", e)
        finally:
            self._fused_done.set()
        self.seconds = time.perf_counter() - t0

    def _compile(self, cfg, tp_size: int, tp_rank: int, device: torch.device, t0: float) -> None:
        from modeling.kv_cache import KVCacheSpec, PagedKVCache
        from modeling.ops import get_kernel_ops
        from modeling.qwen3 import config_projection_warm_up_calls, run_projection_warm_up
        from parallel.context import ParallelContext

        mc = cfg.model_config(device)
        if tp_size > 1:
            self._compile_fused(mc, tp_size, tp_rank, device, self._comm)
        self.fused_seconds = time.perf_counter() - t0
        self._fused_done.set()
        ops = get_kernel_ops(device, cfg.kernel_backend, cfg.kernels.for_model(mc.hidden_size))
        with torch.cuda.device(device), torch.inference_mode():
            stream = torch.cuda.Stream(device)
            with torch.cuda.stream(stream):
                cache = PagedKVCache(KVCacheSpec.for_model(mc, 2, cfg.block_size, tp_size), device)
                k_cache, v_cache = cache.layers[0]
                self.launches = ops.warm_up_attention(k_cache, v_cache, mc.num_heads // tp_size, mc.head_dim ** -0.5)
                calls = config_projection_warm_up_calls(mc, ParallelContext(tp_rank=tp_rank, tp_size=tp_size), ops,
                                                        device)
                self.launches += run_projection_warm_up(calls, device, ops.options.compile_threads)
            stream.synchronize()

    @staticmethod
    def _compile_fused(mc, tp_size: int, tp_rank: int, device: torch.device, comm: Optional[Any]) -> None:
        """The fused TP kernel (`comm.tp_fused_kind`) for the model's hidden size and dtype, as the TP group's
        `SymmMemAllReduce` (default size) will launch it, unless the options turn the symmetric-memory path or the
        fusion off (`parallel.options.CommOptions`)."""
        from parallel.options import CommOptions
        from parallel.symm_allreduce import DEFAULT_MAX_BYTES
        from parallel.symm_fused import warm_up_compile

        comm = comm if comm is not None else CommOptions()
        if comm.tp_allreduce == "nccl" or not comm.tp_fused_norm:
            return
        with torch.cuda.device(device):
            warm_up_compile(mc.hidden_size, mc.dtype, tp_rank, tp_size, DEFAULT_MAX_BYTES, comm.tp_fused_kind)

    def wait_fused(self, timeout_s: float = 60.0) -> None:
        """Wait until the fused TP kernel's compile is done (or failed, or never started), at most `timeout_s`:
        for the group set-up, whose probe would otherwise compile it a second time."""
        self._fused_done.wait(timeout_s)

    def join(self, timeout_s: float = 600.0) -> float:
        """Wait for the compiles; seconds they took (0 if still running after `timeout_s`)."""
        self._thread.join(timeout_s)
        return 0.0 if self._thread.is_alive() else self.seconds
