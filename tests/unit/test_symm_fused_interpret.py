"""The push all-reduce + add + RMSNorm kernel (`parallel.symm_fused`) under the Triton CPU interpreter, two
ranks in two processes over shared-memory CPU buffers (each rank's peer pointers are its own mappings of both
buffers), so a rank really waits for the other's rows. Over calls of changing row counts (both buffer halves,
reuse): the sum equals the fp32 sum of
the two partials rounded to fp16, the normed rows match the unfused arithmetic, both ranks get the same bits,
a rank that starts late is waited for, -0.0 inputs (the push kernel's "not arrived" mark) do not hang it, and
the buffers are all marks again at the end. The pull kernel's system-scope atomics and barriers are
beyond the interpreter; the GPU suite checks it (tests/multigpu/test_symm_allreduce.py)."""
import pytest

from tests.unit._interpret import run_interpreted

pytest.importorskip("triton", reason="needs triton (the Triton CPU interpreter runs its kernels)")

_CHILD = r"""
import json, sys, time
import torch
import torch.multiprocessing as mp
from parallel import symm_fused as sf

H, G, WORLD, MAX_ROWS, EPS = 64, 4, 2, 16, 1e-6
SLOT = MAX_ROWS * H  # elements per rank's rows
CASES = ((3, None), (9, 1), (1, 0), (16, None), (5, 1))  # (rows, the rank that starts 0.3 s late)


def rank_main(rank, bufs, inputs, out_q):
    peers = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.int64)  # this process's mappings
    epochs = torch.zeros(G, dtype=torch.int64)
    outs = []
    for (m, late), (xs, r, w) in zip(CASES, inputs):
        if late == rank:
            time.sleep(0.3)
        x = xs[rank]
        o, s = torch.empty_like(x), torch.empty_like(x)
        sf._ar_push_add_rms_norm_kernel[(G,)](x, r, w, o, s, peers, epochs, m, EPS, WORLD * SLOT, SLOT,
                                              H=H, BLOCK=H, RANK=rank, WORLD=WORLD, G=G, EMPTY=sf.EMPTY_BITS)
        outs.append((o.view(torch.int16).tolist(), s.view(torch.int16).tolist()))  # plain lists: no fds
    out_q.put((rank, outs, epochs.tolist()))


if __name__ == "__main__":
    g = torch.Generator().manual_seed(0)
    bufs = [torch.full((2 * WORLD * SLOT,), -0.0, dtype=torch.float16).share_memory_() for _ in range(WORLD)]
    inputs = []
    for m, _ in CASES:
        xs = [torch.randn(m, H, generator=g).half() for _ in range(WORLD)]
        xs[0][0, :8] = -0.0
        xs[1][m - 1, :] = -0.0
        inputs.append((xs, torch.randn(m, H, generator=g).half(), (torch.rand(H, generator=g) + 0.5).half()))
    ctx = mp.get_context("fork")  # the rank function lives in this -c program
    out_q = ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(k, bufs, inputs, out_q), daemon=True) for k in range(WORLD)]
    for p in procs:
        p.start()
    got = {}
    for _ in range(WORLD):
        rank, outs, epochs = out_q.get(timeout=240)
        got[rank] = (outs, epochs)
    results = []
    for i, ((m, _), (xs, r, w)) in enumerate(zip(CASES, inputs)):
        y = (xs[0].float() + xs[1].float()).half().float()
        want_s = (y + r.float()).half()
        sfl = want_s.float()
        want = ((sfl * torch.rsqrt(sfl.pow(2).mean(-1, keepdim=True) + EPS)).half().float() * w.float()).half()
        o = [(torch.tensor(got[k][0][i][0], dtype=torch.int16).view(torch.float16),
              torch.tensor(got[k][0][i][1], dtype=torch.int16).view(torch.float16)) for k in range(WORLD)]
        results.append({
            "m": m,
            "sum_equal": all(torch.equal(o[k][1], want_s) for k in range(WORLD)),
            "ranks_equal": torch.equal(o[0][0], o[1][0]) and torch.equal(o[0][1], o[1][1]),
            "out_close": all(bool(torch.allclose(o[k][0].float(), want.float(), atol=2e-2, rtol=2e-2))
                             for k in range(WORLD)),
        })
    for p in procs:
        p.join(30)
    clean = all(bool((b.view(torch.int16) == sf.EMPTY_BITS).all()) for b in bufs)  # both ranks done: all read
    print("RESULT" + json.dumps({"calls": results, "epochs": [got[k][1] for k in range(WORLD)], "clean": clean}))
"""


def test_two_ranks_push_rows_reduce_add_and_norm():
    got = run_interpreted(_CHILD)
    assert [c["m"] for c in got["calls"]] == [3, 9, 1, 16, 5]
    for c in got["calls"]:
        assert c["sum_equal"] and c["ranks_equal"] and c["out_close"], c
    assert got["epochs"] == [[5] * 4, [5] * 4]
    assert got["clean"], "a slot was left holding rows after both ranks read them"
