"""`triton_numerics.mass_sum` (int32 work per token) equals the int64 sum of `mass` bit for bit, under the CPU
interpreter: blocks of 1024 tokens at the row maximum (q capped at 2^32 - 1), just above and below the -23 cut,
-inf, not allowed, tiny and huge spreads."""
import pytest

from tests.unit._interpret import run_interpreted

pytest.importorskip("triton", reason="needs triton (the Triton CPU interpreter runs its kernels)")

_CHILD = r"""
import json
import torch
import triton
import triton.language as tl
from modeling.sampler.triton_numerics import mass, mass_sum


@triton.jit
def both_kernel(z, allowed, m, out, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = row * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(z + offs)
    a = tl.load(allowed + offs) != 0
    mm = tl.load(m + row)
    tl.store(out + row * 2, tl.sum(mass(x, mm, a)))
    tl.store(out + row * 2 + 1, mass_sum(x, mm, a))


g = torch.Generator().manual_seed(3)
rows = []
for i in range(12):
    x = torch.randn(1024, generator=g) * (0.01, 0.5, 2.0, 8.0, 30.0, 1.0)[i % 6]
    if i % 4 == 1:
        x[:512] = x.max()  # half the block at the maximum: q = 2^32 - 1 each
    if i % 4 == 2:
        x[::7] = float("-inf")
    if i % 4 == 3:
        mx = float(x.max())
        x[:300] = mx - 23.0 + torch.linspace(-1e-3, 1e-3, 300)  # both sides of the cut
    rows.append(x)
z = torch.stack(rows).float()
z[5] = z[5].bfloat16().float()  # bf16 values: many ties
allowed = (torch.rand(z.shape, generator=g) > 0.1).to(torch.int32)
allowed[0] = 1
m = z.amax(1)
out = torch.zeros(12, 2, dtype=torch.int64)
both_kernel[(12,)](z, allowed, m, out, BLOCK=1024)
print("RESULT" + json.dumps({"plain": out[:, 0].tolist(), "split": out[:, 1].tolist()}))
"""


def test_mass_sum_equals_the_sum_of_masses():
    r = run_interpreted(_CHILD)
    assert r["plain"] == r["split"]
    assert all(v > 0 for v in r["plain"])
    assert max(r["plain"]) > 512 * (2**32 - 1)  # the capped rows are there
