"""`sample`: the batched, capturable sampler. CPU logits take the torch path (`reference.py`); CUDA logits the
Triton kernels (`triton_sampler.py`, imported only then, so a CPU process never imports Triton)."""
from __future__ import annotations

from typing import Any, Optional

import torch

from .collectives import ShardGroup
from .host import SamplerVariant
from .params import SamplerParams
from .reference import SampleOutput, sample_torch

MAX_LOGPROBS = 20


class SamplerUsageError(ValueError):
    """Bad arguments to `sample` (shapes, devices, logprob count)."""


def sample(logits: torch.Tensor, params: SamplerParams, *, num_logprobs: int = 0, vocab_offset: int = 0,
           tp_group: Optional[Any] = None, variant: Optional[SamplerVariant] = None,
           shard_width: Optional[int] = None, backend: str = "auto") -> SampleOutput:
    """Sample one token per row.

    logits: fp32 or bf16 `[B, V_shard]` (row stride free, unit column stride) on the device of `params`;
    rows [0, B) of `params` apply (padded rows: harmless defaults). Under TP (`tp_group` of the vocabulary
    shards) this rank holds global token ids [vocab_offset, vocab_offset + V_shard); every rank returns the
    identical `SampleOutput`, and all ranks must pass the same `variant`, `num_logprobs` and `shard_width`
    (the widest shard's width: it fixes the chunking; default V_shard, right when every shard is as wide).
    variant: which optional stages run (None = all); it must cover `HostBatch.variant()` of the rows.

    Order: logit bias and banned ids -> penalties -> temperature -> min-p / top-k / top-p -> Gumbel-max draw with
    counter-based Philox noise keyed by (seed, position, global token id). Temperature-0 rows take the argmax of
    the processed logits. Logprobs are of the raw logits. No host synchronisation and static shapes on CUDA:
    capturable in a CUDA graph (outputs come from the graph's pool; `params` is read by address).
    backend: "auto" (by device), "torch" or "triton"."""
    if logits.dim() != 2 or logits.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise SamplerUsageError(f"logits must be fp32 / bf16 [B, V], got {tuple(logits.shape)} {logits.dtype}")
    b, v = logits.shape
    if not 1 <= b <= params.max_batch:
        raise SamplerUsageError(f"batch {b} not in [1, max_batch = {params.max_batch}]")
    if logits.device != params.device and not (logits.device.type == params.device.type == "cuda"
                                                and params.device.index is None):
        raise SamplerUsageError(f"logits on {logits.device}, parameters on {params.device}")
    if not 0 <= num_logprobs <= MAX_LOGPROBS:
        raise SamplerUsageError(f"num_logprobs must be in [0, {MAX_LOGPROBS}], got {num_logprobs}")
    if logits.stride(1) != 1:
        raise SamplerUsageError("logits need a unit column stride")
    variant = SamplerVariant.full() if variant is None else variant
    group = ShardGroup(tp_group)
    use_triton = backend == "triton" or (backend == "auto" and logits.is_cuda)
    if use_triton:
        from . import triton_sampler  # noqa: PLC0415  (Triton only when asked for or on CUDA)

        return triton_sampler.sample_triton(logits, params, variant, num_logprobs, vocab_offset, group,
                                            shard_width or v)
    if backend not in ("auto", "torch"):
        raise SamplerUsageError(f"backend must be auto, torch or triton, got {backend!r}")
    return sample_torch(logits, params, variant, num_logprobs, vocab_offset, group)
