"""Every Triton kernel of the batched sampler compiles for a CUDA GPU (sm_90, H100 / H200) on a machine without
one: the launcher (`triton_sampler.sample_triton`) runs on CPU tensors with each kernel's launch recorded instead
of run, and each recorded launch (argument types, constexprs, options) is compiled to PTX and a cubin by Triton's
own compiler and ptxas. The interpreter tests pin what the kernels compute; this pins that the code the GPU gets
is code Triton can compile (the rank's warm-up compiles every variant at start-up, so a kernel that does not
compile stops serving)."""
import numpy as np
import pytest
import torch

triton = pytest.importorskip("triton", reason="needs triton (its compiler and ptxas)")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from modeling.sampler import HostBatch, RowSpec, SamplerParams, SamplerVariant  # noqa: E402
from modeling.sampler import triton_kernels, triton_sampler, triton_select, triton_topp  # noqa: E402
from modeling.sampler.allow_bits import mask_words  # noqa: E402
from modeling.sampler.collectives import ShardGroup  # noqa: E402

V = 151936
CAPS = dict(max_bias=8, max_ban=4, max_penalty_tokens=16)
OPTIONS = ("num_warps", "num_stages", "enable_fp_fusion")
DTYPES = {torch.bfloat16: "bf16", torch.float32: "fp32", torch.int32: "i32", torch.int64: "i64"}


def _recorded_launches(variant: SamplerVariant, n: int, masked: bool = False) -> list:
    """(kernel, positional args, keyword args) of every launch one `sample_triton` call makes."""
    launches = []

    class Recorder:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append((self.kernel, args, kwargs))

    mods = (triton_kernels, triton_select, triton_topp)
    saved = [(m, k, v) for m in mods for k, v in vars(m).items() if isinstance(v, triton.runtime.jit.JITFunction)]
    try:
        for m, k, v in saved:
            setattr(m, k, Recorder(v))
        rows = [RowSpec(temperature=1.0, top_k=20, top_p=0.9, seed=1), RowSpec(temperature=0.7, top_k=300, seed=2),
                RowSpec(temperature=1.0, min_p=0.1, repetition_penalty=1.2, output_token_ids=[5], seed=3)]
        p = SamplerParams(len(rows), "cpu", **CAPS)
        bits = np.full((len(rows), mask_words(V)), -1, np.int32) if masked else None
        p.load(HostBatch.from_rows(rows, vocab_size=V, **CAPS, allow_bits=bits))
        x = torch.zeros(len(rows), V, dtype=torch.bfloat16)
        triton_sampler.sample_triton(x, p, variant, n, 0, ShardGroup(None), V)
    finally:
        for m, k, v in saved:
            setattr(m, k, v)
    return launches


def _arg_type(value) -> str:
    if isinstance(value, torch.Tensor):
        return "*" + DTYPES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(type(value))


def _compile(kernel, args, kwargs) -> dict:
    names = kernel.arg_names
    const = {k: v for k, v in kwargs.items() if k not in OPTIONS}
    values = list(args) + [None] * len(const)
    sig = {name: "constexpr" if name in const else _arg_type(a) for name, a in zip(names, values)}
    src = ASTSource(fn=kernel, signature=sig, constexprs={(names.index(k),): v for k, v in const.items()})
    opts = {k: v for k, v in kwargs.items() if k in OPTIONS}
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts).asm


@pytest.mark.parametrize("variant,n,masked", [(SamplerVariant.full(), 20, False),
                                              (SamplerVariant(top_k=True, top_p=True), 0, False),
                                              (SamplerVariant(top_p=True), 5, False), (SamplerVariant(), 0, False),
                                              (SamplerVariant(processed=True), 0, True)],
                         ids=["full-top20", "topk-topp", "topp-top5", "plain", "processed-allow-mask"])
def test_every_launch_compiles_for_sm90(variant, n, masked):
    launches = _recorded_launches(variant, n, masked)
    names = {k.fn.__name__ for k, _a, _kw in launches}
    assert {"stats_kernel", "sample_kernel", "finish_kernel"} <= names
    if masked:
        assert [kw["HAS_MASK"] for k, _a, kw in launches if k.fn.__name__ == "copy_kernel"] == [True]
    if variant.top_p:
        assert {"topk_compact_kernel", "topp_cand_kernel", "topp_level_kernel"} <= names
    for kernel, args, kwargs in launches:
        asm = _compile(kernel, args, kwargs)
        assert ".entry " + kernel.fn.__name__ in asm["ptx"], kernel.fn.__name__
        assert len(asm["cubin"]) > 0
