"""Armed decode: a rank enqueues its next greedy decode step before the request for it arrives.

A strict round trip (the driver waits for each step's tokens before it sends the next step) leaves the rank
idle between steps, and the host launch of the next step (metadata, transfer, graph launches) then sits in
series with the device, costing more after an idle gap than back to back on these hosts. So right after a rank
launched such a step (its request found nothing in flight, a decode lane took it, its token ids came from the
host, no other request waits), it enqueues the graphs of that lane (`actors.decode_state._DecodeLane`) once more behind
a `HostGate`, on padding rows, while the device still runs the step. When the next request arrives:
- go: it is a greedy decode step with host token ids that replays the same graph (any batch size of the
  bucket); the rank writes it into the staged host buffers and opens the gate, and the device starts within
  microseconds;
- cancel: anything else; the gate opens on the padding rows (the replay writes no KV and its tokens are
  dropped) and the request takes the usual path behind it, so a cancel costs one padded replay of device time.
A gate that waited `wait_s` gives up and replays the padding on its own; a go that comes later is told so by
the gate's acknowledgement and the step takes the usual path.

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


class _Arm:
    __slots__ = ("lane", "seq", "host", "event", "since")

    def __init__(self, lane: Any, seq: int, host: torch.Tensor, event: Any, since: float):
        self.lane, self.seq, self.host, self.event, self.since = lane, seq, host, event, since


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
        self.counts = dict.fromkeys(OUTCOMES, 0)

    @property
    def armed(self) -> bool:
        return self._arm is not None

    def arm(self, runner: Any, lane: Any) -> None:
        """Enqueue `lane`'s decode graph and greedy head graph behind a closed gate, on padding rows, then the
        copy of the bucket's tokens to the host (current stream: the rank's forward stream). Any lane of the
        same graph may take it (another batch size of the bucket)."""
        with self._lock:
            if self._arm is not None:
                return
            p = lane.key.batch
            free = self._free.setdefault(p, [])
            host, event = free.pop() if free else (torch.empty(p, dtype=torch.int64, pin_memory=True),
                                                   torch.cuda.Event())
            seqs: list[int] = []

            def gate() -> None:
                self.gate.enqueue()
                seqs.append(self.gate.take_seq())

            try:
                runner.arm_decode(lane.key, gate)
                lane.replay_head(runner)
                host.copy_(lane.head_out[:p], non_blocking=True)
                event.record()
            except BaseException:
                if seqs:  # let the stream run past a gate that nobody will open
                    self.gate.open(seqs[0], False)
                raise
            self._arm = _Arm(lane, seqs[0], host, event, time.perf_counter())
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
        self._free[arm.host.shape[0]].append((arm.host, arm.event))
        self.counts[outcome] += 1

    def take(self, runner: Any, lane: Any, batch: Any, pending: Callable[..., Any]) -> Optional[Any]:
        """Run the greedy decode step `batch` (host token ids, `lane`'s shape) on the armed replay: its
        `PendingTokens` (the tokens on the device: `lane.tokens`), or None when the arm could not take it
        (another graph, or the gate had given up waiting); the arm is spent either way and the caller runs the
        step the usual way. `pending(host, event, multi, recycle)` makes the `PendingTokens`."""
        with self._lock:
            arm, self._arm = self._arm, None
        if arm is None:
            return None
        stale = not self.collective and time.perf_counter() - arm.since > 0.5 * self.wait_s
        if (arm.lane is not lane and arm.lane.key != lane.key) or stale:
            self._spend(arm, "cancelled")  # stale arms are not raced against the gate's own deadline
            return None
        runner.stage_armed_decode(lane.key, batch.token_ids, batch.num_history, batch.block_tables, lane.block_size)
        self.gate.open(arm.seq, True)
        if not self._acknowledged(arm.seq):  # the gate gave up first: its replay ran on padding (or see below)
            self._spend(arm, "expired")
            if self.collective:
                raise RuntimeError("an armed tensor-parallel decode step's gate gave up waiting before its request "
                                   "came: its padding replay ran the graph's collectives, which the peers may not "
                                   "have matched")
            return None
        self.counts["went"] += 1
        free = self._free[arm.host.shape[0]]
        n = batch.batch_size
        if n == arm.host.shape[0]:
            return pending(arm.host, arm.event, False, free)
        return pending(arm.host[:n], arm.event, False, _ReturnWhole(free, arm.host))

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
