"""The Triton top-p under the CPU interpreter: the threshold key equals the torch path's, row by row.

The sampled tokens of `test_sampler_interpret.py` change only when the threshold moves across the winning token;
here the threshold key itself (the state the sample pass reads) is compared with the reference's `radix_select` on
the same fixed-point masses, for rows that take either way of `triton_topp`: peaked, bulk, flat, few distinct
values (ties across the threshold), a wide range (most masses 0), half the ids banned, top_p near 0 and near 1,
with min-p and top-k before it, fp32 and bf16 logits. Groups of 8 ids and candidates above the 64th largest group
maximum make the candidates a small part of the row, so flat rows' cannot hold the threshold (the radix finds it)
while peaked rows' and top-k rows' do (the shortcut), and a run whose candidates overflow the buffer takes the
radix: every way is pinned equal to the reference.
"""
import pytest

from tests.unit._interpret import run_interpreted

pytest.importorskip("triton", reason="needs triton (the Triton CPU interpreter runs its kernels)")

_CHILD = r"""
import json
import torch
from modeling.sampler import HostBatch, RowSpec, SamplerParams, SamplerVariant
from modeling.sampler import triton_sampler as ts
from modeling.sampler.collectives import ShardGroup
from tests.unit._topp_keys import kernel_key, reference_key, resolved_rows

ts.BLOCK, ts.MAX_CHUNK, ts.SELECT_BLOCK, ts.TOPK_GROUP = 256, 1024, 64, 8
CAPS = dict(max_bias=8, max_ban=4, max_penalty_tokens=16)
V = 3001
TOP_P = (0.9, 0.5, 0.99, 0.01, 0.95, 0.8)


def logits(dtype):
    g = torch.Generator().manual_seed(7)
    rows = []
    for i in range(24):
        kind = i % 6
        x = torch.randn(V, generator=g) * (0.5 + 0.5 * (i % 5))  # bulk of several widths
        if kind == 1:
            x[torch.randint(0, V, (6,), generator=g)] += torch.linspace(14, 6, 6)  # peaked
        elif kind == 2:
            x = x * 0.01  # flat: every token in one or two bins
        elif kind == 3:
            x = torch.round(x)  # few distinct values: ties across the threshold
        elif kind == 4:
            x = x * 12  # wide: most masses 0
        elif kind == 5:
            x[: V // 2] = float("-inf")  # half the ids never allowed
        rows.append(x)
    return torch.stack(rows).to(dtype)


def specs():
    out = []
    for i in range(24):
        extra = {"min_p": 0.05} if i % 4 == 1 else {"top_k": 40} if i % 4 == 2 else {}
        out.append(RowSpec(temperature=(1.0, 0.7, 1.6)[i % 3], top_p=TOP_P[i % len(TOP_P)], seed=i, **extra))
    return out


out = {}
for dtype, groups in ((torch.float32, 64), (torch.bfloat16, 64), ("overflow", 400)):
    ts.TOPP_GROUPS = groups  # 400 > the row's 375 groups: every token a candidate, more than the buffer holds
    x = logits(torch.bfloat16 if dtype == "overflow" else dtype)
    b = x.shape[0]
    p = SamplerParams(b, "cpu", **CAPS)
    p.load(HostBatch.from_rows(specs(), vocab_size=V, **CAPS))
    state = {}
    ts.sample_triton(x, p, SamplerVariant(top_k=True, top_p=True), 0, 0, ShardGroup(None), V, state=state)
    want, key_lo = reference_key(x, p)
    res = resolved_rows(state)
    key_lo_equal = all(bool(state["st"][4, r, 0] == key_lo[r]) for r in range(b) if not res[r])
    out[str(dtype)] = {"want": want.tolist(), "got": kernel_key(state).tolist(), "key_lo_equal": key_lo_equal,
                       "resolved": res, "top_k": [s.top_k for s in specs()]}
print("RESULT" + json.dumps(out))
"""


@pytest.fixture(scope="module")
def results() -> dict:
    return run_interpreted(_CHILD, timeout_s=600)


@pytest.mark.parametrize("dtype", ["torch.float32", "torch.bfloat16", "overflow"])
def test_top_p_threshold_equals_the_reference(results, dtype):
    r = results[dtype]
    assert r["key_lo_equal"]
    for row, (want, got) in enumerate(zip(r["want"], r["got"])):
        assert got == want, (dtype, row, r["resolved"][row])


@pytest.mark.parametrize("dtype", ["torch.float32", "torch.bfloat16"])
def test_both_ways_are_taken(results, dtype):
    """Top-k rows always resolve from their candidates (with bf16 ties at tau too); of the others, peaked rows do
    and flat rows do not."""
    r = results[dtype]
    assert all(r["resolved"][row] for row in range(24) if r["top_k"][row])
    others = [r["resolved"][row] for row in range(24) if not r["top_k"][row]]
    assert any(others) and not all(others), others
    assert r["resolved"][1] and r["resolved"][7]  # peaked rows (kind 1), without top-k
    assert not r["resolved"][8] and not r["resolved"][20]  # flat rows (kind 2), top_p 0.99


def test_overflowing_candidates_take_the_radix(results):
    """Candidates past the buffer (here: every token of rows with fewer groups than the top-p count) are
    detected: those rows take the radix levels (and the threshold still equals the reference's, above)."""
    r = results["overflow"]
    assert all(r["resolved"][row] for row in range(24) if r["top_k"][row])
    assert not any(r["resolved"][row] for row in range(24) if not r["top_k"][row])
