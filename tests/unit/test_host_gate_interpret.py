"""The armed-decode gate kernel (`modeling.ops.triton_gate`, state in `actors.host_gate`) under the Triton CPU interpreter.

One execution per case, in order, on one gate state (the device counter carries over between executions):
opened with go before the kernel runs, opened with cancel, never opened (gives up after its poll budget),
opened for a later sequence number only (an earlier execution must not pass on it), and a go written for an
execution that had already given up (the next execution must not take it as its own)."""

import pytest

from tests.unit._interpret import run_interpreted

pytest.importorskip("triton", reason="needs triton (the Triton CPU interpreter runs its kernels)")

_CHILD = r"""
import json
import torch
from modeling.ops.triton_gate import host_gate_kernel

ctl = torch.zeros(1, dtype=torch.int64)
ack = torch.zeros(1, dtype=torch.int64)
expected = torch.ones(1, dtype=torch.int64)

def run(word, polls=50):
    if word is not None:
        ctl[0] = word
    host_gate_kernel[(1,)](ctl, ack, expected, polls)
    return {"ack": int(ack[0]), "expected": int(expected[0])}

out = [
    run(2 * 1 + 1),   # seq 1: go
    run(2 * 2 + 0),   # seq 2: cancel
    run(None),        # seq 3: nobody opens it -> gives up
    run(2 * 3 + 1),   # seq 4: a late go for seq 3 is not seq 4's go -> gives up
    run(2 * 5 + 1),   # seq 5: go
]
print("RESULT" + json.dumps(out))
"""


def test_gate_verdicts_and_sequence():
    got = run_interpreted(_CHILD)
    assert got == [
        {"ack": 3, "expected": 2},
        {"ack": 4, "expected": 3},
        {"ack": 6, "expected": 4},
        {"ack": 8, "expected": 5},
        {"ack": 11, "expected": 6},
    ]
