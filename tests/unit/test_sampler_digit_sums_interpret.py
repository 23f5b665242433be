"""The top-p passes' per-digit mass sums (`triton_select.add_by_digit`: the block sorted by digit, one atomic per
run) under the Triton CPU interpreter equal the plain per-element sums (numpy `add.at`), for spread and
concentrated digits, skipped lanes (digit 4095) and zero masses, at two block sizes."""
import pytest

from tests.unit._interpret import run_interpreted

pytest.importorskip("triton", reason="needs triton (the Triton CPU interpreter runs its kernels)")

_CHILD = r"""
import json
import numpy as np, torch, triton, triton.language as tl
from modeling.sampler.triton_select import add_by_digit


@triton.jit
def sums(dig, q, out, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    add_by_digit(out, tl.load(dig + i), tl.load(q + i))


rng = np.random.default_rng(0)
res = []
for block in (64, 256):
    for spread in (2048, 30, 1):
        d = rng.integers(0, spread, block)
        d[rng.random(block) < 0.3] = 4095
        q = rng.integers(0, 2**32, block)
        q[rng.random(block) < 0.2] = 0
        out = torch.zeros(2056, dtype=torch.int64)
        for _ in range(2):  # a second block adds on top
            sums[(1,)](torch.tensor(d), torch.tensor(q), out, BLOCK=block)
        want = np.zeros(4096, np.int64)
        np.add.at(want, d, 2 * q)
        res.append(bool((out.numpy()[:2048] == want[:2048]).all()) and int(out[2048:].abs().sum()) == 0)
print("RESULT" + json.dumps(res))
"""


def test_run_sums_equal_per_element_sums():
    assert run_interpreted(_CHILD) == [True] * 6
