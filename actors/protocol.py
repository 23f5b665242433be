"""The per-step plan the coordinator sends to every rank, and how it is decided (pure, Ray-free).

The coordinator sees every DP rank's batch, so it decides the global phase itself (no
per-step metadata all-gather between ranks):
- without collectives across DP groups (ep == 1, or dp == 1) each DP group decides alone:
  `global_decode=None`, no bucket hints, idle DP groups do not run at all;
- with EP across DP groups, every rank must run the same kind of step with the same
  bucket so the EP collectives pair up: decode only if every DP rank decodes or is
  idle (batch bucket = the largest batch, rounded up to a decode bucket; idle ranks run
  a dummy decode of that bucket); otherwise a global prefill (token bucket = the largest
  token count, rounded up to a piecewise bucket; a locally decoding rank gets
  `global_decode=False` and replays the token-bucket plan, whose eager attention
  boundary picks the decode kernel from live metadata; idle ranks run a dummy prefill).
`static_tokens` is the EP dispatcher's row count for the step (decode: the batch bucket;
prefill: None = exchange counts inside the MoE eager boundary).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from actors.batch import StepBatch


@dataclass(frozen=True)
class StepPlan:
    """What every rank receives for one step (pickled once per step; numpy inside)."""

    batches: tuple[Optional[StepBatch], ...]  # indexed by DP rank
    global_decode: Optional[bool]  # None = each DP group decides alone
    batch_bucket: int = 0
    token_bucket: int = 0
    run_idle: bool = False  # idle DP ranks run a dummy step (collectives cross DP groups)
    static_tokens: Optional[int] = None
    phase: str = "local"  # "decode" | "prefill" | "mixed" | "local" (for status)
    num_steps: int = 1  # multi-step decode: every rank runs this many decode steps back to back
    # the driver waits for this step's tokens before it sends anything else: tensor-parallel ranks may arm the
    # next decode step behind it (`actors.armed`; TP = 1 ranks decide alone); pipe step path only
    arm_next: bool = False

    def rank_args(self, dp_rank: int) -> Optional[tuple]:
        """(batch, global_decode, batch_bucket, token_bucket) for `execute`, or None: nothing to run."""
        b = self.batches[dp_rank]
        if b is None and not self.run_idle:
            return None
        gd = self.global_decode
        return b, gd, self.batch_bucket, self.token_bucket


def round_up(n: int, buckets: Sequence[int]) -> int:
    """The smallest bucket >= n, or n itself when none is (eager beyond the largest bucket)."""
    fit = [b for b in buckets if b >= n]
    return min(fit) if fit else n


def plan_step(batches: Sequence[Optional[StepBatch]], *, cross_dp: bool, decode_buckets: Sequence[int],
              token_buckets: Sequence[int], num_steps: int = 1) -> Optional[StepPlan]:
    """The plan of one step, or None when every DP rank is idle. `num_steps > 1` needs every active batch
    to decode: the caller checks each batch with `StepBatch.check_multi_step` first."""
    batches = tuple(batches)
    if batches.count(None) == len(batches):
        return None
    if not cross_dp:
        return _plan(batches, None, phase="local", num_steps=num_steps)
    active = [b for b in batches if b is not None]
    decoding = [b.is_decoding for b in active]
    if all(decoding):
        bucket = round_up(max(b.batch_size for b in active), decode_buckets)
        return _plan(batches, True, batch_bucket=bucket, run_idle=True, static_tokens=bucket, phase="decode",
                     num_steps=num_steps)
    tokens = round_up(max(b.num_tokens for b in active), token_buckets)
    return _plan(batches, False, token_bucket=tokens, run_idle=True, phase="mixed" if any(decoding) else "prefill")


def _plan(batches: tuple, global_decode: Optional[bool], batch_bucket: int = 0, token_bucket: int = 0,
          run_idle: bool = False, static_tokens: Optional[int] = None, phase: str = "local",
          num_steps: int = 1, arm_next: bool = False) -> StepPlan:
    """`StepPlan(...)` (same arguments and defaults) without the frozen dataclass's per-field
    `object.__setattr__`, which costs about a microsecond a step; the same object in every respect."""
    plan = object.__new__(StepPlan)
    d = plan.__dict__
    d["batches"], d["global_decode"] = batches, global_decode
    d["batch_bucket"], d["token_bucket"], d["run_idle"] = batch_bucket, token_bucket, run_idle
    d["static_tokens"], d["phase"], d["num_steps"], d["arm_next"] = static_tokens, phase, num_steps, arm_next
    return plan


def with_arm_next(plan: StepPlan) -> StepPlan:
    """`plan` marked `arm_next` (a copy; `dataclasses.replace` without its per-field cost)."""
    out = object.__new__(StepPlan)
    out.__dict__.update(plan.__dict__)
    out.__dict__["arm_next"] = True
    return out
