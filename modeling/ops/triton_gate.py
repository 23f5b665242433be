"""The armed-decode gate kernel (`actors.host_gate.HostGate` owns its state): one program polls a word of pinned
host memory until the host writes the execution's sequence number there. Words and protocol: see
`actors/host_gate.py`."""
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["max_polls"])
def host_gate_kernel(ctl_ptr, ack_ptr, expected_ptr, max_polls):
    want = tl.load(expected_ptr)
    word = tl.load(ctl_ptr, volatile=True)
    polls = max_polls * 0
    while ((word >> 1) < want) & (polls < max_polls):
        word = tl.load(ctl_ptr, volatile=True)
        polls += 1
    go = ((word >> 1) == want) & ((word & 1) == 1)
    tl.store(ack_ptr, want * 2 + go.to(tl.int64))
    tl.store(expected_ptr, want + 1)
