"""The timing path of the projection measurement (`triton_gemm_measure.time_candidates`) on the CPU: the skinny GEMM
runs under the Triton interpreter and F.linear on the host, while the CUDA graph, its capture and the CUDA events
are stand-ins that run the captured calls eagerly and keep a fake clock (each replay of the first graph costs 1 ms,
of the second 0.5 ms). Checks what is captured (one eager call, then `calls` calls cycling over the weight copies,
each candidate equal to F.linear), that every timed replay counts, and the per-call seconds and best-of-rounds
arithmetic; and that a projection measured in its fused form times the same operators on both sides (SiLU-gate,
GEMM, residual add + RMSNorm: three operators after cuBLAS, one fused skinny-GEMM launch) with equal outputs. The
real timing needs a GPU (tests/gpu/test_projection_measure.py)."""
import pytest

from tests.unit._interpret import run_interpreted

pytest.importorskip("triton", reason="needs triton (the Triton CPU interpreter runs the skinny GEMM)")

_CHILD = r"""
import contextlib, json
import torch
import torch.nn.functional as F
from modeling.ops import triton_gemm, triton_gemm_measure as tgm

clock = [0.0]
graphs, calls, weights, errors = [], [], set(), []

class Graph:
    def __init__(self):
        self.cost = 1.0 if not graphs else 0.5
        self.replays = 0
        graphs.append(self)
    def replay(self):
        self.replays += 1
        clock[0] += self.cost

class Event:
    def __init__(self, enable_timing=False):
        assert enable_timing
    def record(self):
        self.t = clock[0]
    def synchronize(self):
        pass
    def elapsed_time(self, end):
        return end.t - self.t

@contextlib.contextmanager
def capture(graph, capture_error_mode):
    assert capture_error_mode == "thread_local" and graph is graphs[-1]
    yield

real_linear, real_skinny = F.linear, triton_gemm.linear_with_config

def linear(x, w):
    calls.append("cublas"); weights.add(w.data_ptr())
    return real_linear(x, w)

def skinny(x, w, cfg, pdl=0):
    calls.append(("skinny", pdl)); weights.add(w.data_ptr())
    y = real_skinny(x, w, cfg, pdl=pdl)
    errors.append((y.float() - real_linear(x.float(), w.float())).abs().max().item())
    return y

torch.cuda.CUDAGraph, torch.cuda.Event, tgm.KeepOriginalErrorGraph = Graph, Event, capture
tgm.F = type("F", (), {"linear": staticmethod(linear)})
triton_gemm.linear_with_config = skinny
tgm._MAX_COPIES = 3
cublas_s, safe_s = tgm.time_candidates(64, 256, 4, (16, 64, 2, 4, 2), torch.device("cpu"), torch.float16, 0, 2)
print("RESULT" + json.dumps({"cublas_s": cublas_s, "safe_s": safe_s, "replays": [g.replays for g in graphs],
                             "calls": [c if isinstance(c, str) else list(c) for c in calls],
                             "weights": len(weights), "max_err": max(errors)}))
"""


_FUSED_CHILD = r"""
import contextlib, json
import torch
import torch.nn.functional as F
from modeling.ops import triton_fused, triton_gemm, triton_gemm_measure as tgm

class Graph:
    def replay(self):
        pass

class Event:
    def __init__(self, enable_timing=False):
        pass
    def record(self):
        pass
    def synchronize(self):
        pass
    def elapsed_time(self, end):
        return 1.0

@contextlib.contextmanager
def capture(graph, capture_error_mode):
    yield

calls, outs = [], {}

def recorded(name, fn):
    def call(*a, **k):
        out = fn(*a, **k)
        calls.append(name)
        outs[name] = out
        return out
    return call

torch.cuda.CUDAGraph, torch.cuda.Event, tgm.KeepOriginalErrorGraph = Graph, Event, capture
tgm.F = type("F", (), {"linear": staticmethod(recorded("cublas", F.linear))})
for mod, name in ((triton_fused, "silu_and_mul"), (triton_fused, "add_rms_norm"),
                  (triton_gemm, "linear_add_rms_norm_with_config")):
    setattr(mod, name, recorded(name, getattr(mod, name)))
tgm._MAX_COPIES = 2
tgm.time_candidates(64, 128, 4, (16, 64, 2, 4, 2), torch.device("cpu"), torch.float16, 0, 1, form="gated_add_norm")
(ref_normed, ref_sum), (normed, summed) = outs["add_rms_norm"], outs["linear_add_rms_norm_with_config"]
print("RESULT" + json.dumps({"calls": calls, "normed_err": (normed.float() - ref_normed.float()).abs().max().item(),
                             "sum_err": (summed.float() - ref_sum.float()).abs().max().item()}))
"""


def test_the_fused_form_times_the_operators_the_model_runs_on_both_sides():
    r = run_interpreted(_FUSED_CHILD)
    calls = 16  # max(_MIN_CALLS, copies)
    assert r["calls"] == (["silu_and_mul", "cublas", "add_rms_norm"] * (1 + calls)
                          + ["linear_add_rms_norm_with_config"] * (1 + calls))
    assert r["normed_err"] < 5e-2 and r["sum_err"] < 2e-2  # both sides compute the same thing (last weight copy)


def test_time_candidates_captures_both_candidates_and_times_every_replay():
    r = run_interpreted(_CHILD)
    calls = 16  # max(_MIN_CALLS, copies): three copies of a 32 KiB weight
    assert r["calls"] == ["cublas"] * (1 + calls) + [["skinny", 0]] * (1 + calls)
    assert r["weights"] == 3 and r["max_err"] < 2e-2
    assert r["replays"] == [1 + 3 * 2, 1 + 3 * 2]  # one after the capture, then 3 rounds of 2
    assert r["cublas_s"] == pytest.approx(1.0e-3 / calls) and r["safe_s"] == pytest.approx(0.5e-3 / calls)
