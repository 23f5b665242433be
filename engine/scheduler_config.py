"""`SchedulerConfig`: one DP rank's scheduling limits and policies (frozen, validated)."""
from __future__ import annotations

from dataclasses import dataclass

SCHEDULING_POLICIES = ("fcfs", "priority")


@dataclass(frozen=True)
class SchedulerConfig:
    """max_num_seqs: running sequences per DP rank; max_num_batched_tokens: tokens of one step (chunked: decode
    rows plus prefill chunks; phased: one prefill step, a single longer sequence still admitted alone);
    watermark_blocks: free blocks kept back when admitting next to running sequences (damps admit/preempt
    ping-pong); decode_steps: decode steps per scheduling round when no running sequence needs sampler extras
    (multi-step decode); enable_chunked_prefill: the chunked policy (`engine.chunking`), in force when the budget is below
    max_model_len; enable_prefix_caching: reuse cached full blocks (`engine.block_manager`); scheduling_policy: "fcfs"
    (arrival order) or "priority" (a request's `priority`, lower first, then arrival order: `Scheduler.add`)."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 4096
    max_model_len: int = 4096
    watermark_blocks: int = 1
    decode_steps: int = 1
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    scheduling_policy: str = "fcfs"

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "decode_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.watermark_blocks < 0:
            raise ValueError("watermark_blocks must be >= 0")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {SCHEDULING_POLICIES}, got {self.scheduling_policy!r}")

    @property
    def chunked(self) -> bool:
        """Chunked prefill is in force: on, and a prompt can be longer than one step's budget."""
        return self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len
