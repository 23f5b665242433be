"""Batched, capturable token sampler: device parameter block, torch reference path, Triton kernels.

- `host.py`: `RowSpec` (per-row Python values) -> `HostBatch` (validated numpy arrays); `SamplerVariant`.
- `params.py`: `SamplerParams`, the device block (pinned staging, one copy per step).
- `numerics.py`: bit-exact Philox noise, log / exp, keys (torch); `triton_numerics.py` the same in Triton.
- `reference.py`: the torch path (CPU) and `SampleOutput`; `triton_sampler.py` (launcher) + `triton_kernels.py`
  (processing, statistics, Gumbel-max, logprobs) + `triton_select.py` (top-k / top-p selection): CUDA.
- `api.py`: `sample(logits, params, ...)`.

Triton is imported only for CUDA logits (or `backend="triton"`).
"""
from .api import MAX_LOGPROBS, SamplerUsageError, sample
from .host import HostBatch, RowSpec, SamplerParamError, SamplerVariant
from .params import SamplerParams
from .reference import SampleOutput

__all__ = ["HostBatch", "MAX_LOGPROBS", "RowSpec", "SampleOutput", "SamplerParamError", "SamplerParams",
           "SamplerUsageError", "SamplerVariant", "sample"]
