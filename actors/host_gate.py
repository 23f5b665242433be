"""A device-side gate that the host opens: what an armed decode step waits behind (`actors.armed`).

The rank enqueues its next decode step before the request arrives, behind one kernel that polls a word in
pinned host memory until the host writes this execution's sequence number there, with a verdict: go (the
host staged the live step) or cancel (the staged rows stay padding). The kernel acknowledges the sequence
number and whether it saw a go in a second pinned word, so the host can tell a gate that gave up waiting
(after `max_polls` polls) from one that saw its go.

Words (int64): control = 2 * seq + go, written by the host; ack = 2 * seq + ran, written by the device;
expected = the sequence number the next execution waits for, a device counter the kernel advances. Each
execution of a graph holding the gate consumes one sequence number, whatever its verdict; the host counts
executions in `HostGate.next_seq`. Lifetime: the rank's; the tensors' addresses are baked into captured graphs.
"""
from __future__ import annotations

from typing import Optional

import torch


class HostGate:
    """One rank's gate state (see the module docstring). `open` and `ran` are host-only and cheap (a store / a
    load of pinned memory)."""

    def __init__(self, device: torch.device, max_polls: int):
        if device.type != "cuda":
            raise RuntimeError("armed decode graphs need a CUDA device")
        from modeling.ops.triton_gate import host_gate_kernel  # a GPU-only kernel module: imported on CUDA only

        self._kernel = host_gate_kernel
        pin = True
        self.control = torch.zeros(1, dtype=torch.int64, pin_memory=pin)
        self.ack = torch.zeros(1, dtype=torch.int64, pin_memory=pin)
        self._control, self._ack = self.control.numpy(), self.ack.numpy()
        self.expected = torch.ones(1, dtype=torch.int64, device=device)
        self.max_polls = int(max_polls)
        self.next_seq = 1  # the sequence number the next gate execution waits for

    def enqueue(self) -> None:
        """Enqueue the gate kernel on the current stream (capturable); the stream's later work waits for it."""
        self._kernel[(1,)](self.control, self.ack, self.expected, self.max_polls, num_warps=1)

    def warm_up(self) -> None:
        """Compile the kernel (at start-up, not at the first arm): one execution opened beforehand."""
        self.open(self.next_seq, False)
        self.enqueue()
        self.take_seq()
        torch.cuda.synchronize(self.expected.device)

    def take_seq(self) -> int:
        """The sequence number of a gate execution just enqueued (each one consumes one)."""
        seq = self.next_seq
        self.next_seq += 1
        return seq

    def open(self, seq: int, go: bool) -> None:
        """Let the execution `seq` pass, running its body (`go`) or skipping it."""
        self._control[0] = 2 * seq + int(go)

    def ran(self, seq: int) -> Optional[bool]:
        """Whether execution `seq` ran its body: None while it has not finished waiting (read it after an event
        recorded behind the gate completed to get a final answer)."""
        word = int(self._ack[0])
        if word >> 1 != seq:
            return None
        return bool(word & 1)
