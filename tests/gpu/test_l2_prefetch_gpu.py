"""The L2 prefetch kernel (`modeling/ops/triton_prefetch.py`) on the GPU: it writes nothing (the weights keep their
bits), runs eagerly and inside a CUDA graph with the rank's PDL mode, and a rank that prefetches
(`KernelOptions.l2_prefetch_mb`) produces the same greedy tokens step after step as one that does not, at batches
that take the norm-first layout (1-2) and the default one (8)."""
import numpy as np
import pytest
import torch

from actors.rank import RankRuntime, RuntimeConfig
from bench.graph_bench import _decode_batch
from graphrunner.config import GraphRunnerConfig
from modeling.ops.options import KernelOptions
from parallel.context import ParallelContext

pytestmark = pytest.mark.gpu


def test_the_kernel_writes_nothing_eager_or_replayed():
    from modeling.ops.pdl import pdl_mode
    from modeling.ops.triton_prefetch import l2_prefetch

    g = torch.Generator(device="cuda").manual_seed(0)
    ws = [torch.randn(n, 1024, device="cuda", generator=g).bfloat16() for n in (1024, 3000, 77)]
    before = [w.clone() for w in ws]
    pdl = pdl_mode(torch.device("cuda"), "early")
    for budget in (0, 100, 3 << 20, 64 << 20):
        l2_prefetch(ws, max_bytes=budget, pdl=pdl)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        l2_prefetch(ws, max_bytes=8 << 20, pdl=pdl)
        y = ws[0] * 2  # a kernel after it in the same graph sees its inputs as before
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(w, b) for w, b in zip(ws, before))
    assert torch.equal(y, before[0] * 2)


def _runtime(prefetch_mb: int) -> RankRuntime:
    cfg = RuntimeConfig(model="qwen3-0.6b", device="cuda", num_kv_blocks=256,
                        graph=GraphRunnerConfig(max_decode_batch=8, pcg_max_tokens=0),
                        kernels=KernelOptions(l2_prefetch_mb=prefetch_mb))
    rt = RankRuntime(cfg, ParallelContext(), torch.device("cuda", 0))
    rt.load_model()
    rt.allocate_kv_cache()
    rt.build_runner()
    rt.capture_all()
    return rt


@torch.inference_mode()
def test_a_prefetching_rank_decodes_the_same_tokens():
    plain, prefetching = _runtime(0), _runtime(24)
    assert plain.model.kernels.l2_prefetch is None and prefetching.model.kernels.l2_prefetch is not None
    for batch in (1, 2, 8):
        tokens = np.full(batch, 7, dtype=np.int64)
        for step in range(12):
            a = np.asarray(plain.execute(_decode_batch(plain, batch, 100 + step, tokens)))
            b = np.asarray(prefetching.execute(_decode_batch(prefetching, batch, 100 + step, tokens)))
            assert np.array_equal(a, b), (batch, step)
            tokens = a.astype(np.int64)
