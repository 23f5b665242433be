"""Armed decode: a rank enqueues its next decode step before the request for it arrives.

A strict round trip (the driver waits for each step's tokens before it sends the next step) leaves the rank
idle between steps, and the host launch of the next step (metadata, transfer, graph launches) then sits in
series with the device, costing more after an idle gap than back to back on these hosts. So right after a rank
launched such a step (its request found nothing in flight, a decode lane took it, its token ids came from the
host, no other request waits), it enqueues the graphs of that lane (`actors.decode_state._DecodeLane`) once more behind
a `HostGate`, on padding rows, while the device still runs the step. When the next request arrives:
- go: it is a decode step with host token ids that replays the same graph (any batch size of the bucket) and
  the same LM head (greedy, or the same captured sampler head: `actors.step_sampler.GraphHead`); the rank
  writes it into the staged host buffers and opens the gate, and the device starts within microseconds;
- cancel: anything else; the gate opens on the padding rows (the replay writes no KV and its tokens are
  dropped) and the request takes the usual path behind it, so a cancel costs one padded replay of device time.
A gate that waited `wait_s` gives up and replays the padding on its own; a go that comes later is told so by
the gate's acknowledgement and the step takes the usual path.

A sampled step (a captured sampler head served it) arms with that head. On the forward stream, in order: the
gate; the decode staging's transfer (`graphrunner.staging.HostStaging.copy_prefix`) and the decode graph; the
transfer of the heads' sampler parameters (`SamplerParams.arm_upload`: rows of one pinned mirror of its ring);
the sampler head graph; the copies of its outputs (tokens, and for a logprob head the tokens and logprobs packed
by `actors.step_sampler.pack_logprobs`, whole buckets) to pinned host buffers. Both transfers come after the gate, so they read
their pinned mirrors only once it opened; a go writes both mirrors (`stage_armed_decode`, then
`SamplerParams.stage_armed`) before it opens the gate. A cancel leaves the staging mirror as padding and the
sampler mirror with the rows it last held (valid rows: defaults, or an earlier step's), and drops every output. Each row's draw is keyed by its (seed, position), so a go
draws the very tokens the unarmed path draws on the same graphs.

Tensor-parallel ranks arm too, collectively (`collective=True`): a cancelled replay runs every collective of
the graph, so the ranks of a TP group must arm, go and cancel alike. The driver decides what timing would
otherwise decide: it marks the steps after which it waits for the tokens (`StepPlan.arm_next`: the only ones
after which these ranks arm), every rank sees the same requests in the same order (so go and cancel, taken from
the request alone, agree), and instead of a gate that gives up on its own after `wait_s` (its deadline would pass
on one rank and not another) the driver sends every rank a disarm after `wait_s` without a request. A rank that
fails to arm, or whose gate still gave up (after about 45 minutes of waiting), fails its next step: its peers
may have done otherwise. Expert-parallel ranks never arm (their DP peers run other batches).
"""
from __future__ import annotations

import threading
import time
from typing import Any, Callable, Optional

import torch

from actors.host_gate import HostGate

# Seconds one poll of the gate's host word takes on the device (a read across PCIe); sets its poll budget. Measured
# on an H200: 20 000 polls in 25.9 ms (tests/gpu/test_armed_decode.py prints it).
GATE_POLL_S = 1.3e-6
# What `ArmedDecode.counts` counts: arms made, and how each ended (a request took it / cancelled / the gate gave up)
OUTCOMES = ("armed", "went", "cancelled", "expired")
# How long the host waits for the gate to acknowledge an opened gate before it calls the device stuck.
ACK_TIMEOUT_S = 5.0
# A collective gate's poll budget: the largest int32 (the kernel's type for it), about 45 minutes of polls; the
# driver's disarm ends the wait long before.
COLLECTIVE_MAX_POLLS = 2**31 - 1


def _pinned(shape: Any, dtype: torch.dtype) -> torch.Tensor:
    """A pinned host buffer for an arm's outputs (its device-to-host copy runs asynchronously)."""
    return torch.empty(shape, dtype=dtype, pin_memory=True)


def _event() -> Any:
    return torch.cuda.Event()


class _Arm:
    """`host`: the pinned int64 token buffer of a greedy arm, or the tuple of pinned buffers of a sampled arm's
    head outputs; `head`: None (greedy) or the sampled arm's `GraphHead`; `params`, `slot`: the sampled arm's
    `SamplerParams` and the mirror its upload reads."""

    __slots__ = ("lane", "seq", "host", "event", "since", "head", "params", "slot")

    def __init__(self, lane: Any, seq: int, host: Any, event: Any, since: float, head: Any = None,
                 params: Any = None, slot: int = -1):
        self.lane, self.seq, self.host, self.event, self.since = lane, seq, host, event, since
        self.head, self.params, self.slot = head, params, slot


def arm_serves(armed_lane: Any, armed_head: Any, lane: Any, head: Any) -> bool:
    """Whether an arm of `armed_lane`'s decode graph with LM head `armed_head` (None: greedy, else the sampler
    head's `actors.step_sampler.GraphHead`) may take a step of `lane` that needs head `head`: the same graph
    (`key`: any batch size of the bucket) and the same head (name and logprobs), so that the go replays exactly
    what the unarmed path would."""
    return (armed_lane is lane or armed_lane.key == lane.key) and armed_head == head


class _ReturnWhole:
    """Where `PendingTokens` hands back a buffer it saw as a row slice: puts the whole pinned buffer back."""

    __slots__ = ("free", "host")

    def __init__(self, free: list, host: torch.Tensor):
        self.free, self.host = free, host

    def append(self, pair: tuple) -> None:
        self.free.append((self.host, pair[1]))


class ArmedDecode:
    """One rank's armed step (at most one at a time) and its counters. Thread-safe: the step loop arms and
    takes; set-up calls on other threads `cancel` before they touch the device. Lifetime: the rank's; an arm
    never outlives the graphs it replays (the rank cancels before dropping or capturing graphs)."""

    def __init__(self, device: torch.device, wait_s: float, collective: bool = False):
        """`collective`: the rank's decode graphs hold collectives (tensor parallelism): no deadline of its own
        (see the module docstring)."""
        self.collective = collective
        self.gate = HostGate(device, max_polls=COLLECTIVE_MAX_POLLS if collective else max(1, int(wait_s / GATE_POLL_S)))
        self.wait_s = wait_s
        self._lock = threading.Lock()
        self._arm: Optional[_Arm] = None
        self._free: dict[int, list] = {}  # bucket -> (pinned int64 [bucket], event) pairs for the tokens
        # (bucket, outputs) -> (pinned buffers of a sampler head's outputs, event) pairs of sampled arms
        self._free_sampled: dict[tuple[int, int], list] = {}
        self.counts = dict.fromkeys(OUTCOMES, 0)

    @property
    def armed(self) -> bool:
        return self._arm is not None

    def arm(self, runner: Any, lane: Any, head: Any = None, params: Any = None) -> None:
        """Enqueue `lane`'s decode graph and an LM head behind a closed gate, on padding rows, then the copy of
        the head's outputs to the host (current stream: the rank's forward stream). `head` None: the greedy head;
        else the `GraphHead` of the captured sampler head the step just launched took, whose parameter block
        `params` (`SamplerParams`; None for a head that reads no staged rows, `StepSampler.head_params`) is
        uploaded between the decode graph and the head (see the module docstring).
        Any lane of the same graph may take it (another batch size of the bucket)."""
        with self._lock:
            if self._arm is not None:
                return
            p = lane.key.batch
            if head is None:
                free = self._free.setdefault(p, [])
                host, event = free.pop() if free else (_pinned(p, torch.int64), _event())
            else:
                outs = runner.epilogue_outputs(p, head.name)
                if outs is None:
                    raise RuntimeError(f"no captured sampler head {head.name!r} for decode bucket {p}")
                free = self._free_sampled.setdefault((p, len(outs)), [])
                host, event = free.pop() if free else (tuple(_pinned(o.shape, o.dtype) for o in outs), _event())
            seqs: list[int] = []
            slot = -1

            def gate() -> None:
                self.gate.enqueue()
                seqs.append(self.gate.take_seq())

            try:
                runner.arm_decode(lane.key, gate)  # pad the staging, gate, staging transfer, decode graph
                if head is None:
                    lane.replay_head(runner)
                    host.copy_(lane.head_out[:p], non_blocking=True)
                else:
                    if params is not None:  # the mirror keeps its rows; the go writes the live ones before opening
                        slot = params.arm_upload(p)
                    runner.replay_epilogue(p, head.name)
                    for h, o in zip(host, outs):
                        h.copy_(o, non_blocking=True)
                event.record()
            except BaseException:
                if seqs:  # let the stream run past a gate that nobody will open
                    self.gate.open(seqs[0], False)
                raise
            self._arm = _Arm(lane, seqs[0], host, event, time.perf_counter(), head, params, slot)
            self.counts["armed"] += 1

    def cancel(self) -> None:
        """Open the gate on the padding rows (no-op when nothing is armed). Never blocks."""
        with self._lock:
            arm, self._arm = self._arm, None
            if arm is not None:
                self._spend(arm, "cancelled")

    def _spend(self, arm: _Arm, outcome: str) -> None:
        if outcome == "cancelled":
            self.gate.open(arm.seq, False)
        # later copies into the buffer run after this one's on the stream: it may serve the next step at once
        self._free_list(arm).append((arm.host, arm.event))
        self.counts[outcome] += 1

    def _free_list(self, arm: _Arm) -> list:
        if arm.head is None:
            return self._free[arm.host.shape[0]]
        return self._free_sampled[(arm.lane.key.batch, len(arm.host))]

    def take(self, runner: Any, lane: Any, batch: Any, pending: Callable[..., Any], head: Any = None,
             rows: Any = None, rows_key: Any = None) -> Optional[Any]:
        """Run the decode step `batch` (host token ids, `lane`'s shape) on the armed replay: its `PendingTokens`
        (the tokens on the device: `lane.tokens` for a greedy step, the sampler head's first output for a sampled
        one), or None when the arm could not take it (another graph or head, or the gate had given up waiting);
        the arm is spent either way and the caller runs the step the usual way. `head`: None for a greedy step,
        else the `GraphHead` the step needs, with `rows` its `HostBatch` for the heads' parameter block and
        `rows_key` their key (`StepSampler.graph_head`; None: unknown).
        `pending(host, event, multi, recycle, logprobs=None)` makes the `PendingTokens`."""
        with self._lock:
            arm, self._arm = self._arm, None
        if arm is None:
            return None
        stale = not self.collective and time.perf_counter() - arm.since > 0.5 * self.wait_s
        if stale or not arm_serves(arm.lane, arm.head, lane, head):
            self._spend(arm, "cancelled")  # stale arms are not raced against the gate's own deadline
            return None
        try:  # both mirrors hold the live step before the gate opens; the transfers behind it read them after
            runner.stage_armed_decode(lane.key, batch.token_ids, batch.num_history, batch.block_tables,
                                      lane.block_size)
            if arm.params is not None:
                arm.params.stage_armed(arm.slot, rows, rows_key)
        except BaseException:
            self._spend(arm, "cancelled")  # the padding rows the mirrors may half hold are dropped like padding
            raise
        self.gate.open(arm.seq, True)
        if not self._acknowledged(arm.seq):  # the gate gave up first: its replay ran on padding (or see below)
            self._spend(arm, "expired")
            if self.collective:
                raise RuntimeError("an armed tensor-parallel decode step's gate gave up waiting before its request "
                                   "came: its padding replay ran the graph's collectives, which the peers may not "
                                   "have matched")
            return None
        self.counts["went"] += 1
        n = batch.batch_size
        if head is not None:
            return self._sampled_pending(arm, n, head, pending)
        free = self._free[arm.host.shape[0]]
        if n == arm.host.shape[0]:
            return pending(arm.host, arm.event, False, free)
        return pending(arm.host[:n], arm.event, False, _ReturnWhole(free, arm.host))

    def _sampled_pending(self, arm: _Arm, n: int, head: Any, pending: Callable[..., Any]) -> Any:
        """A sampled go's `PendingTokens`: the first `n` rows of the head's tokens, or for a logprob head of its
        packed tokens and logprobs (`actors.step_sampler.pack_logprobs`), of which the step keeps its N, as the
        unarmed path reads them back."""
        host = arm.host
        back = _ReturnWhole(self._free_list(arm), host)
        if head.num_logprobs < 0:
            return pending(host[0][:n], arm.event, False, back)
        return pending(host[1][:n], arm.event, False, back, logprobs=head.num_logprobs)

    def _acknowledged(self, seq: int) -> bool:
        """Wait (spinning, microseconds) for the gate's verdict on execution `seq`: True when it saw the go.
        False means it had given up, and its replay may have read half-written rows; every KV slot such a
        replay writes is a slot of this very step, which the caller's usual-path run rewrites after it."""
        deadline = time.perf_counter() + ACK_TIMEOUT_S
        while (ran := self.gate.ran(seq)) is None:
            if time.perf_counter() > deadline:
                raise RuntimeError(f"the armed decode gate did not answer within {ACK_TIMEOUT_S:.0f} s: "
                                   "the rank's forward stream is stuck")
        return ran
