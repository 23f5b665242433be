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
The phase and buckets reach every rank as one `StepHints` (`StepPlan.hints`; the pipe step path packs its three
scalars, `actors.wire`), which the rank turns into its `graphrunner.step.ForwardStep`'s hints.

The driver hands plans to a step path through a `Stepper` (plain actor calls, a compiled graph: the whole step in
`run`) or a `PipelinedStepper` (the pipe path: `send` now, `receive` later, so the driver may submit ahead).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Optional, Protocol, Sequence

from actors.batch import StepBatch


@dataclass(frozen=True)
class StepHints:
    """The coordinator's hints for one rank's forward step, alike on every rank of the step (so that DP ranks whose
    collectives pair up pick the same graph). Crosses driver -> rank inside `StepPlan` (pickled, or packed as three
    scalars by `actors.wire`); on the rank it becomes `ForwardStep.global_decode` / `batch_bucket_hint` /
    `token_bucket_hint` (`actors.decode_state.forward_step`), and it is part of a decode lane's key. Hashable."""

    global_decode: Optional[bool] = None  # None = each DP group decides alone; False = run the prefill paths
    batch_bucket: int = 0  # the decode batch bucket is at least this (0: no bound)
    token_bucket: int = 0  # the prefill token bucket is at least this (0: no bound)


NO_HINTS = StepHints()  # a step each DP group decides alone
# one rank's share of a plan, the `RankRuntime.launch` arguments: (its DP rank's batch, None for an idle rank's dummy
# step; the plan's hints). `StepPlan.rank_args` on the plain and compiled paths, `actors.wire.decode_request` on pipes
RankArgs = tuple[Optional[StepBatch], StepHints]


def step_hints(global_decode: Optional[bool], batch_bucket: int, token_bucket: int) -> StepHints:
    """`StepHints(...)` without the frozen dataclass's per-field `object.__setattr__`; the same object."""
    hints = object.__new__(StepHints)
    d = hints.__dict__
    d["global_decode"], d["batch_bucket"], d["token_bucket"] = global_decode, batch_bucket, token_bucket
    return hints


@dataclass(frozen=True)
class StepPlan:
    """What every rank receives for one step (pickled once per step; numpy inside)."""

    batches: tuple[Optional[StepBatch], ...]  # indexed by DP rank
    hints: StepHints = NO_HINTS  # the phase and buckets every rank's step follows
    run_idle: bool = False  # idle DP ranks run a dummy step (collectives cross DP groups)
    static_tokens: Optional[int] = None
    phase: str = "local"  # "decode" | "prefill" | "mixed" | "local" (for status)
    num_steps: int = 1  # multi-step decode: every rank runs this many decode steps back to back
    # the driver waits for this step's tokens before it sends anything else: tensor-parallel ranks may arm the
    # next decode step behind it (`actors.armed`; TP = 1 ranks decide alone); pipe step path only
    arm_next: bool = False

    def rank_args(self, dp_rank: int) -> Optional[RankArgs]:
        """This DP rank's `RankArgs` (batch, hints), or None: nothing to run."""
        b = self.batches[dp_rank]
        if b is None and not self.run_idle:
            return None
        return b, self.hints


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
        return _plan(batches, NO_HINTS, phase="local", num_steps=num_steps)
    active = [b for b in batches if b is not None]
    decoding = [b.is_decoding for b in active]
    if all(decoding):
        bucket = round_up(max(b.batch_size for b in active), decode_buckets)
        return _plan(batches, step_hints(True, bucket, 0), run_idle=True, static_tokens=bucket, phase="decode",
                     num_steps=num_steps)
    tokens = round_up(max(b.num_tokens for b in active), token_buckets)
    return _plan(batches, step_hints(False, 0, tokens), run_idle=True, phase="mixed" if any(decoding) else "prefill")


def _plan(batches: tuple, hints: StepHints = NO_HINTS, run_idle: bool = False, static_tokens: Optional[int] = None,
          phase: str = "local", num_steps: int = 1, arm_next: bool = False) -> StepPlan:
    """`StepPlan(...)` (same arguments and defaults) without the frozen dataclass's per-field
    `object.__setattr__`, which costs about a microsecond a step; the same object in every respect."""
    plan = object.__new__(StepPlan)
    d = plan.__dict__
    d["batches"], d["hints"], d["run_idle"] = batches, hints, run_idle
    d["static_tokens"], d["phase"], d["num_steps"], d["arm_next"] = static_tokens, phase, num_steps, arm_next
    return plan


def with_arm_next(plan: StepPlan) -> StepPlan:
    """`plan` marked `arm_next` (a copy; `dataclasses.replace` without its per-field cost)."""
    out = object.__new__(StepPlan)
    out.__dict__.update(plan.__dict__)
    out.__dict__["arm_next"] = True
    return out


class Stepper(Protocol):
    """The driver side of a step path (`actors.coordinator_paths` makes one): carries each `StepPlan` to every rank.
    `run` sends a plan and waits: per rank (TP rank 0's tokens, else None; in-rank seconds). `pipelined`: whether
    it is a `PipelinedStepper` (the coordinator then sends at submit and receives at collect; the coordinator reads
    it rather than an `isinstance` check, which costs microseconds a step). A stepper declares what it implements by
    subclassing one of the two."""

    name: ClassVar[str]  # "pipe" | "compiled" | "plain"
    pipelined: ClassVar[bool] = False

    def run(self, plan: StepPlan, timeout_s: float) -> list[tuple[Any, float]]: ...

    def teardown(self) -> None: ...


class PipelinedStepper(Stepper, Protocol):
    """A `Stepper` whose steps may overlap (`pipelined = True`): `send` writes a plan to every rank and returns;
    `receive` waits for the replies to the oldest plan sent (in send order), what `run` returns."""

    pipelined: ClassVar[bool] = True

    def send(self, plan: StepPlan) -> None: ...

    def receive(self, plan: StepPlan, timeout_s: float) -> list[tuple[Any, float]]: ...
