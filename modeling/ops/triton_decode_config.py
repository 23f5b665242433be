"""Host side of the split-KV decode attention (`modeling.ops.triton_decode`): its static launch config, chosen from
shapes only, and the per-device arrival counters of its single-launch combine (the documented process-wide state
described there). Kept apart from the kernels; `triton_decode` re-exports every name."""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton

LOG2E = 1.4426950408889634
TARGET_WAVES = 4  # aim for about this many programs per SM in the split kernel
MAX_SPLITS = 64
# Batches up to this take the prefetch before the PDL wait by default: it held the K and V tile in registers
# through the wait and paid off only at one sequence (docs/benchmarks.md, twenty-fifth session).
PREFETCH_MAX_BATCH = 1
COMBINE_CHUNK = 8  # splits one combine step loads at once (16 raised ptxas spills of the split kernel, sm_90)
_COUNTER_SLOTS = 1 << 16  # one per (sequence, KV head): B * Hkv <= 65536 (e.g. 256 sequences x 256 KV heads)


class DecodeNotWarmedUpError(RuntimeError):
    """The decode arrival counters of a device would be allocated inside CUDA graph capture."""


@dataclass(frozen=True)
class DecodeConfig:
    """Static launch parameters of the decode kernels. num_stages: software-pipeline stages of the split kernel's
    tile loop (1: none). prefetch: the split kernel loads the lengths, its first tile's block-table entries and
    that tile's K and V before its PDL wait (when the tile ends before the step's new token), overlapping the kernels
    ahead of it; the bits are the same either way."""

    block_n: int
    num_splits: int
    num_warps: int
    num_stages: int
    prefetch: bool = False


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def device_sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of `device`; a fixed stand-in on CPU (Triton interpreter)."""
    if device.type != "cuda":
        return 132
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def decode_config(
    batch: int,
    num_kv_heads: int,
    max_blocks_per_seq: int,
    block_size: int,
    head_dim: int,
    dtype: torch.dtype,
    sm_count: int,
) -> DecodeConfig:
    """Pick tile size and split count from static shapes only (CUDA-graph safe)."""
    block_n = 32 if dtype == torch.float32 or head_dim > 128 else 64
    max_tiles = max(1, -(-max_blocks_per_seq * block_size // block_n))
    programs = max(1, batch * num_kv_heads)
    # powers of two bound the number of compiled variants across batch buckets
    # ... and of the live block-table width of eager calls: a split beyond the tiles exits at once
    splits = min(triton.next_power_of_2(-(-TARGET_WAVES * sm_count // programs)), MAX_SPLITS,
                 triton.next_power_of_2(max_tiles))
    return DecodeConfig(block_n=block_n, num_splits=splits, num_warps=4, num_stages=1,
                        prefetch=batch <= PREFETCH_MAX_BATCH)


_counters: dict[torch.device, torch.Tensor] = {}


def decode_counters(device: torch.device) -> torch.Tensor:
    """The device's int32 `[_COUNTER_SLOTS]` split-arrival counters (zero between launches); allocated on first use.

    Lives for the process; separate from `triton_gemm.split_k_counters`. Raises `DecodeNotWarmedUpError` if the
    first use is inside CUDA graph capture. (A CPU device only occurs under TRITON_INTERPRET=1.)
    """
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    cnt = _counters.get(device)
    if cnt is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise DecodeNotWarmedUpError("call modeling.ops.triton_decode.decode_attention once on this device "
                                         "before capture")
        cnt = torch.zeros(_COUNTER_SLOTS, dtype=torch.int32, device=device)
        _counters[device] = cnt
    return cnt
