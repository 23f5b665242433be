"""Split-KV decode attention (single launch and two-kernel path) under the Triton CPU interpreter.

Skipped where triton is not installed. As in test_gemm_interpret.py, the kernels run in one child
process started with TRITON_INTERPRET=1 (Triton picks interpreted functions when it is imported);
this process only compares. Dtypes are fp32 and fp16: the interpreter's `tl.dot` multiplies bf16
as its raw uint16 storage (triton 3.9). The interpreter runs programs one after another, so this
checks the split arithmetic, the empty-split and padding handling, the last-arrival combine, the
bitwise equality with the two-kernel path and with the first KV tile loaded before the PDL wait or not (`prefetch`;
the cases' splits start on tiles that end before the new token and on the one holding it), the counter reset;
the memory ordering between concurrent programs needs a GPU (tests/gpu/test_triton_kernels.py).
"""
import json

import pytest
import torch

from tests.unit._interpret import run_interpreted

pytest.importorskip("triton", reason="needs triton (the Triton CPU interpreter runs its kernels)")

DTYPES = ("float32", "float16")
# name -> (Hq, Hkv, D, block size, table width, kv lengths, [(BLOCK_N, splits) or None = decode_config])
CASES = {
    "b1_long": (4, 2, 64, 16, 12, [150], [(16, 4), (16, 8), (32, 1)]),
    # seq 1 fills one tile of 8 splits (7 empty), seq 2 is a padded row (kv_len 0: every split empty);
    # 16 splits: seq 0 fills 10 of them, combined in two chunks of 8 (the second one partly masked)
    "b3_short_and_pad": (4, 2, 128, 16, 20, [300, 7, 0], [(32, 8), (16, 3), (16, 16)]),
    "b2_group4_default": (8, 2, 64, 16, 4, [64, 33], [None]),  # exact block boundary; S from the heuristic
}

_CHILD = r"""
import json, sys
import torch
from modeling.ops import attention_ref as ref
from modeling.ops import triton_decode as td

def paged(hq, hkv, d, bs, width, lens, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // bs) for n in lens]
    blocks = sum(need) + 3
    k_cache = torch.randn(blocks, bs, hkv, d, generator=g).to(dtype)
    v_cache = torch.randn(blocks, bs, hkv, d, generator=g).to(dtype)
    ids = (torch.randperm(blocks - 1, generator=g) + 1).tolist()  # non-contiguous, block 0 reserved
    tables = torch.zeros(len(lens), width, dtype=torch.int32)
    for i, n in enumerate(need):
        tables[i, :n] = torch.tensor([ids.pop() for _ in range(n)], dtype=torch.int32)
    q = torch.randn(len(lens), hq, d, generator=g).to(dtype)
    return q, k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int32)

out = {}
for name, (hq, hkv, d, bs, width, lens, configs) in json.loads(sys.argv[1]).items():
    for dt in json.loads(sys.argv[2]):
        q, kc, vc, tables, kv = paged(hq, hkv, d, bs, width, lens, getattr(torch, dt), seed=len(out))
        scale = d ** -0.5
        expected = ref.decode_attention(q.float(), kc.float(), vc.float(), tables, kv, scale)
        for c in configs:
            cfg = None if c is None else td.DecodeConfig(block_n=c[0], num_splits=c[1], num_warps=4, num_stages=2)
            used = cfg or td.decode_config(len(lens), hkv, width, bs, d, q.dtype, td.device_sm_count(q.device))
            one = td.decode_attention(q, kc, vc, tables, kv, scale, config=cfg)
            counters = int(td.decode_counters(q.device).count_nonzero())
            two = td.decode_attention(q, kc, vc, tables, kv, scale, config=cfg, single_launch=False)
            forced = [td.decode_attention(q, kc, vc, tables, kv, scale, config=cfg, prefetch=p) for p in (False, True)]
            out[f"{name},{dt},{json.dumps(c)}"] = {
                "splits": used.num_splits, "dtype": str(one.dtype), "shape": list(one.shape),
                "err": (one.float() - expected).abs().max().item(), "equal_two_kernel": torch.equal(one, two),
                "equal_prefetch_forced": [torch.equal(one, other) for other in forced],
                "pad_rows_zero": all(int(one[i].count_nonzero()) == 0 for i, n in enumerate(lens) if n == 0),
                "counters_nonzero": counters}

# B * Hkv above the counter slots: the two-kernel fallback, counters untouched (a 4-slot stand-in holding 7s)
q, kc, vc, tables, kv = paged(4, 2, 64, 16, 20, [300, 7, 0], torch.float32, seed=99)
cfg = td.DecodeConfig(block_n=16, num_splits=4, num_warps=4, num_stages=2)
saved = td._counters[q.device]
td._counters[q.device] = torch.full((4,), 7, dtype=torch.int32)
try:
    few = td.decode_attention(q, kc, vc, tables, kv, 0.125, config=cfg)
    stand_in = td._counters[q.device].tolist()
finally:
    td._counters[q.device] = saved
out["fallback"] = {"equal_two_kernel": torch.equal(few, td.decode_attention(q, kc, vc, tables, kv, 0.125, config=cfg,
                                                                             single_launch=False)),
                   "stand_in": stand_in}
print("RESULT" + json.dumps(out))
"""


@pytest.fixture(scope="module")
def results() -> dict:
    return run_interpreted(_CHILD, CASES, DTYPES)


_PARAMS = [pytest.param(name, dt, c, id=f"{name}-{dt}-{'default' if c is None else 'n%d_s%d' % c}")
           for name, case in CASES.items() for dt in DTYPES for c in case[-1]]


@pytest.mark.parametrize("name,dtype,config", _PARAMS)
def test_interpreted_single_launch_matches_reference_and_two_kernels(results, name, dtype, config):
    hq, _, d, _, _, lens, _ = CASES[name]
    r = results[f"{name},{dtype},{json.dumps(config)}"]
    assert r["dtype"] == f"torch.{dtype}" and r["shape"] == [len(lens), hq, d]
    assert r["err"] < (1e-5 if dtype == "float32" else 5e-3), r  # fp16: inputs and output rounding
    assert r["equal_two_kernel"], "single launch differs bitwise from split + reduce kernels"
    assert r["equal_prefetch_forced"] == [True, True], "the loads before the PDL wait change the bits"
    assert r["pad_rows_zero"]
    assert r["counters_nonzero"] == 0


def test_cases_cover_multi_split_and_direct_write(results):
    splits = {r["splits"] for key, r in results.items() if key != "fallback"}
    assert 1 in splits and {3, 4, 8, 16} <= splits


def test_too_many_programs_fall_back_to_two_kernels(results):
    assert results["fallback"] == {"equal_two_kernel": True, "stand_in": [7, 7, 7, 7]}


def test_counters_refuse_allocation_during_capture(monkeypatch):
    from modeling.ops import triton_decode as td

    dev = torch.device("cuda", 12345)  # never allocated: the check runs before any CUDA call
    monkeypatch.setattr("torch.cuda.is_current_stream_capturing", lambda: True)
    with pytest.raises(td.DecodeNotWarmedUpError):
        td.decode_counters(dev)
    assert dev not in td._counters


def test_one_sequence_steps_load_their_first_tile_before_the_wait():
    from modeling.ops import triton_decode as td

    picks = {b: td.decode_config(b, 8, 640, 64, 128, torch.bfloat16, 132).prefetch for b in (1, 2, 4, 64, 256)}
    assert picks == {1: True, 2: False, 4: False, 64: False, 256: False}
    assert td.PREFETCH_MAX_BATCH == 1 and td.decode_config(1, 8, 640, 64, 128, torch.bfloat16, 132).num_stages == 1
