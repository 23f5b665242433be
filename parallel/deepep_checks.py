"""What DeepEP can run, checked before any DeepEP buffer exists (torch-free: the driver runs it too).

The limits are DeepEP's own host asserts, which fire only once a buffer exists and a kernel launches:
- dtype: `SWITCH_TYPES` (csrc/kernels/launch.cuh) has bfloat16 only (combine, low-latency dispatch without fp8).
- hidden: the low-latency kernels are templates instantiated for a fixed list of hidden sizes (`SWITCH_HIDDEN`,
  csrc/kernels/launch.cuh of deepseek-ai/DeepEP; 3072 arrived with gpt-oss support, older builds lack it; the
  newest kernels add 3584, left out here so that every build with 3072 accepts what this list accepts).
- ranks: the intranode kernels are instantiated for 2, 4 and 8 ranks (`SWITCH_RANKS`); internode DeepEP (more
  than 8 ranks, NVSHMEM over RDMA) is not supported here.
- top-k: the low-latency kernels take at most 9 experts per token (`kNumMaxTopK`, csrc/kernels/internode_ll.cu).
- experts: every rank owns the same number of experts.
- token cap: `low_latency_dispatch` takes at most `num_max_dispatch_tokens_per_rank` tokens per rank, the cap
  the RDMA buffer is sized for (`CommOptions.deepep_max_tokens_per_rank`); the largest decode bucket's per-rank
  chunk must fit.
"""
from __future__ import annotations

import math
from typing import Any

from parallel.options import DEEPEP_MAX_TOKENS_ENV

DEEPEP_DTYPE = "bfloat16"
DEEPEP_HIDDEN_SIZES = (2048, 2560, 3072, 4096, 5120, 6144, 7168, 8192)
DEEPEP_EP_SIZES = (2, 4, 8)
DEEPEP_MAX_TOPK = 9


class DeepEPConfigError(ValueError):
    """DeepEP cannot serve this deployment (dtype, hidden size, EP size, top-k, token cap, ...)."""


def dtype_name(dtype: Any) -> str:
    """"bfloat16" for torch.bfloat16 or "bfloat16"."""
    return str(dtype).removeprefix("torch.")


def tokens_per_rank(largest_decode_bucket: int, tp_size: int) -> int:
    """Rows one rank hands the low-latency dispatch in the largest decode step (its 1/tp chunk of the bucket)."""
    return math.ceil(max(1, largest_decode_bucket) / max(1, tp_size))


def deepep_problems(*, dtype: Any, hidden: int, num_experts: int, top_k: int, ep_size: int, tp_size: int,
                    largest_decode_bucket: int, max_tokens_per_rank: int) -> list[str]:
    """One line per reason DeepEP cannot run this deployment, each naming its fix; empty when it can."""
    out = []
    if num_experts <= 0:
        return ["the DeepEP backend needs a MoE model (this one is dense): drop --ep or use a MoE model"]
    if dtype_name(dtype) != DEEPEP_DTYPE:
        out.append(f"DeepEP moves bfloat16 tokens only, the model runs {dtype_name(dtype)}: pass --dtype bfloat16 "
                   "(RuntimeConfig.dtype='bfloat16')")
    if hidden not in DEEPEP_HIDDEN_SIZES:
        out.append(f"DeepEP's low-latency kernels are compiled for hidden sizes "
                   f"{', '.join(map(str, DEEPEP_HIDDEN_SIZES))} only, the model's hidden_size is {hidden}: serve a "
                   "model of one of those sizes or use --ep-backend allgather")
    if ep_size not in DEEPEP_EP_SIZES:
        out.append(f"DeepEP runs its intranode kernels here, on 2, 4 or 8 ranks of one node, and ep is {ep_size}: use "
                   "--ep 2, 4 or 8 (internode DeepEP is not supported) or --ep-backend allgather")
    elif num_experts % ep_size:
        out.append(f"num_experts {num_experts} is not divisible by ep {ep_size}: pick an ep that divides it")
    if top_k > DEEPEP_MAX_TOPK:
        out.append(f"DeepEP's low-latency kernels route at most {DEEPEP_MAX_TOPK} experts per token, the model "
                   f"routes {top_k}: use --ep-backend allgather")
    need = tokens_per_rank(largest_decode_bucket, tp_size)
    if need > max_tokens_per_rank:
        out.append(f"DeepEP's low-latency token cap deepep_max_tokens_per_rank={max_tokens_per_rank} is below the "
                   f"{need} tokens per rank of the largest decode bucket {largest_decode_bucket} (tp {tp_size}): "
                   f"raise {DEEPEP_MAX_TOKENS_ENV} to at least {need} or lower --max-decode-batch to "
                   f"{max_tokens_per_rank * max(1, tp_size)}")
    return out


def check_deepep_config(**kwargs: Any) -> None:
    """`deepep_problems(**kwargs)`, raised as one `DeepEPConfigError` (one line, every problem) when any."""
    problems = deepep_problems(**kwargs)
    if problems:
        raise DeepEPConfigError("ep_backend=deepep cannot run this deployment: " + "; ".join(problems))
