"""`modeling.ops.pdl`: the PDL option is parsed strictly, defaults to early, and never turns PDL on for the CPU or
for kernels built for the Triton interpreter (the kernels' `PDL` constexpr stays 0 there, with no `launch_pdl`
option). No environment is read: the mode comes from `KernelOptions.pdl`."""
import pytest
import torch

pytest.importorskip("triton", reason="modeling.ops.pdl defines Triton helpers; triton is not installed")

from modeling.ops import pdl  # noqa: E402
from modeling.ops.options import KernelOptions, KernelOptionsError  # noqa: E402


def test_default_is_off_on_the_cpu():
    assert KernelOptions().pdl == "early"
    assert pdl.pdl_mode(torch.device("cpu")) == 0
    assert pdl.pdl_launch(torch.device("cpu")) == {"PDL": 0}


@pytest.mark.parametrize("raw", ["1", "early"])
def test_cpu_and_interpreter_never_launch_with_pdl(monkeypatch, raw):
    assert pdl.pdl_mode(torch.device("cpu"), raw) == 0
    monkeypatch.setattr(pdl, "_INTERPRETED", True)  # decided before any device query: no CUDA needed here
    assert pdl.pdl_mode(torch.device("cuda", 0), raw) == 0
    assert not pdl.pdl_enabled(torch.device("cuda", 0), raw)
    assert not pdl.pdl_supported(torch.device("cuda", 0))


@pytest.mark.parametrize("raw", ["on", "2", "", "Early"])
def test_a_bad_value_names_the_variable_and_the_choices(raw):
    with pytest.raises(ValueError, match=r"GRAPHLINE_PDL=.*use 0 \(off\), 1 .* or early \(the default\)"):
        pdl.pdl_mode(torch.device("cpu"), raw)
    with pytest.raises(KernelOptionsError, match=r"GRAPHLINE_PDL=.*use 0 \(off\), 1 .* or early \(the default\)"):
        KernelOptions(pdl=raw)


def test_modes_where_the_gpu_and_triton_support_it(monkeypatch):
    monkeypatch.setattr(pdl, "_triton_has_pdl", lambda: True)
    monkeypatch.setattr(pdl, "_device_has_pdl", lambda index: index == 0)  # GPU 0 is sm_90, GPU 1 older
    monkeypatch.setattr(pdl, "_INTERPRETED", False)
    gpu0, gpu1 = torch.device("cuda", 0), torch.device("cuda", 1)
    assert pdl.pdl_mode(gpu0) == 2 and pdl.pdl_mode(gpu1) == 0  # early by default where the GPU has it
    assert pdl.pdl_supported(gpu0) and not pdl.pdl_supported(gpu1)
    assert pdl.pdl_supported(gpu0)  # whatever the option says
    for raw, mode in (("0", 0), ("1", 1), ("early", 2)):
        assert pdl.pdl_mode(gpu0, raw) == mode and pdl.pdl_mode(gpu1, raw) == 0
        assert pdl.pdl_launch(gpu0, raw) == ({"PDL": mode, "launch_pdl": True} if mode else {"PDL": 0})
        assert pdl.PDL_LAUNCH[mode] is pdl.pdl_launch(gpu0, raw)  # built once, shared by every launch
    monkeypatch.setattr(pdl, "_triton_has_pdl", lambda: False)  # a Triton without the launch_pdl option
    assert pdl.pdl_mode(gpu0) == 0


def test_kernels_built_here_are_not_interpreted():
    assert pdl.interpreted() is False  # this test process does not set TRITON_INTERPRET
