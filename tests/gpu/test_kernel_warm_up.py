"""The early attention warm-up (`actors.kernel_warm_up.KernelWarmUp`, over a two-block cache, before the rank has
its KV cache) compiles exactly the variants `RankRuntime.build_runner` asks for over the real cache: afterwards
build_runner compiles nothing more."""
import pytest
import torch

from actors.kernel_warm_up import KernelWarmUp
from actors.rank import RankRuntime, RuntimeConfig
from graphrunner.config import GraphRunnerConfig
from parallel.context import ParallelContext

pytestmark = pytest.mark.gpu


def _variants(kernel) -> int:
    return sum(len(entry[0]) for entry in kernel.device_caches.values())


def test_early_warm_up_compiles_what_build_runner_needs():
    from modeling.ops.triton_decode import _decode_split_kernel
    from modeling.ops.triton_prefill import _prefill_kernel

    cfg = RuntimeConfig(model="qwen3-0.6b", device="cuda", num_kv_blocks=300, max_model_len=2048,
                        graph=GraphRunnerConfig(max_decode_batch=8, pcg_max_tokens=0), armed_decode_wait_ms=0)
    for kernel in (_decode_split_kernel, _prefill_kernel):
        kernel.device_caches.clear()  # earlier tests compiled some variants: count this warm-up's own
    early = KernelWarmUp(cfg, 1, torch.device("cuda", 0))
    # decode: 7 split counts with and without the loads before the PDL wait; + 5 projections at 1-4 rows (0.6B:
    # GEMV_AUTO_ROWS)
    assert early.join() > 0 and early.error is None and early.launches == 17 + 5 * 4
    warmed = (_variants(_decode_split_kernel), _variants(_prefill_kernel))
    assert warmed == (14, 3), warmed
    rt = RankRuntime(cfg, ParallelContext(), torch.device("cuda", 0))
    rt.load_model()
    rt.allocate_kv_cache()
    rt.build_runner()
    assert (_variants(_decode_split_kernel), _variants(_prefill_kernel)) == warmed, \
        "build_runner compiled attention variants the early warm-up missed (the caches' layouts differ)"


def test_a_failing_early_warm_up_is_kept_not_raised():
    cfg = RuntimeConfig(model="qwen3-0.6b", device="cuda")
    early = KernelWarmUp(cfg, 1, torch.device("cuda", torch.cuda.device_count() + 3))  # no such GPU
    early.join()
    assert early.error is not None and early.launches == 0
