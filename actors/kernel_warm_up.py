"""A rank's attention-kernel compiles, started before its process groups form (overlapping NCCL set-up, the
symmetric-memory rendezvous and the weight load on a cold Triton cache).

Triton specialises a kernel on dtypes, constants, pointer alignment and the divisibility of integer arguments,
not on sizes, so a two-block KV cache of the deployment's layout (`KVCacheSpec.for_model`, this rank's share of
the KV heads) compiles exactly the attention variants `RankRuntime.build_runner` then asks for over the real
cache. Lifetime: one background thread per rank at start-up, on its own CUDA stream; the worker joins it before
`build_runner`. A failure here is logged, never raised: `build_runner` compiles whatever is still missing and
reports its own errors.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Optional

import torch

log = logging.getLogger(__name__)


class KernelWarmUp:
    """Compile the attention variants of `cfg`'s model for a rank of `tp_size`-way tensor parallelism on `device`
    (CUDA), in a daemon thread started by the constructor. `cfg`: an `actors.rank.RuntimeConfig`."""

    def __init__(self, cfg, tp_size: int, device: torch.device):
        self.seconds = 0.0
        self.launches = 0
        self.error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._run, args=(cfg, tp_size, device), name="kernel-warm-up",
                                        daemon=True)
        self._thread.start()

    def _run(self, cfg, tp_size: int, device: torch.device) -> None:
        from modeling.kv_cache import KVCacheSpec, PagedKVCache
        from modeling.ops import get_kernel_ops

        t0 = time.perf_counter()
        try:
            mc = cfg.model_config(device)
            ops = get_kernel_ops(device, cfg.kernel_backend)
            with torch.cuda.device(device), torch.inference_mode():
                stream = torch.cuda.Stream(device)
                with torch.cuda.stream(stream):
                    cache = PagedKVCache(KVCacheSpec.for_model(mc, 2, cfg.block_size, tp_size), device)
                    k_cache, v_cache = cache.layers[0]
                    launches = ops.warm_up_attention(k_cache, v_cache, mc.num_heads // tp_size, mc.head_dim ** -0.5)
                stream.synchronize()
                self.launches = launches
        except BaseException as e:  # noqa: BLE001 - build_runner compiles what is missing and raises there
            self.error = e
            log.warning("early attention kernel warm-up failed (build_runner will compile instead): %s", e)
        self.seconds = time.perf_counter() - t0

    def join(self, timeout_s: float = 600.0) -> float:
        """Wait for the compiles; seconds they took (0 if still running after `timeout_s`)."""
        self._thread.join(timeout_s)
        return 0.0 if self._thread.is_alive() else self.seconds
