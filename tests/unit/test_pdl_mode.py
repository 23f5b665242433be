"""`modeling.ops.pdl`: the GRAPHLINE_PDL switch is parsed strictly, defaults to early, and never turns PDL on for the
CPU or under the Triton interpreter (the kernels' `PDL` constexpr stays 0 there, with no `launch_pdl` option)."""
import pytest
import torch

pytest.importorskip("triton", reason="modeling.ops.pdl defines Triton helpers; triton is not installed")

from modeling.ops import pdl  # noqa: E402


def test_default_is_off_on_the_cpu(monkeypatch):
    monkeypatch.delenv(pdl.PDL_ENV, raising=False)
    assert pdl.pdl_mode(torch.device("cpu")) == 0
    assert pdl.pdl_launch(torch.device("cpu")) == {"PDL": 0}


@pytest.mark.parametrize("raw", ["1", "early"])
def test_cpu_and_interpreter_never_launch_with_pdl(monkeypatch, raw):
    monkeypatch.setenv(pdl.PDL_ENV, raw)
    assert pdl.pdl_mode(torch.device("cpu")) == 0
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # decided before any device query: no CUDA needed here
    assert pdl.pdl_mode(torch.device("cuda", 0)) == 0
    assert not pdl.pdl_enabled(torch.device("cuda", 0))
    assert not pdl.pdl_supported(torch.device("cuda", 0))


@pytest.mark.parametrize("raw", ["on", "2", "", "Early"])
def test_a_bad_value_names_the_variable_and_the_choices(monkeypatch, raw):
    monkeypatch.setenv(pdl.PDL_ENV, raw)
    with pytest.raises(ValueError, match=r"GRAPHLINE_PDL=.*use 0 \(off\), 1 .* or early \(the default\)"):
        pdl.pdl_mode(torch.device("cpu"))


def test_modes_where_the_gpu_and_triton_support_it(monkeypatch):
    monkeypatch.setattr(pdl, "_triton_has_pdl", lambda: True)
    monkeypatch.setattr(pdl, "_device_has_pdl", lambda index: index == 0)  # GPU 0 is sm_90, GPU 1 older
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    gpu0, gpu1 = torch.device("cuda", 0), torch.device("cuda", 1)
    monkeypatch.delenv(pdl.PDL_ENV, raising=False)
    assert pdl.pdl_mode(gpu0) == 2 and pdl.pdl_mode(gpu1) == 0  # early by default where the GPU has it
    assert pdl.pdl_supported(gpu0) and not pdl.pdl_supported(gpu1)
    monkeypatch.setenv(pdl.PDL_ENV, "0")
    assert pdl.pdl_supported(gpu0)  # whatever the switch says
    for raw, mode in (("0", 0), ("1", 1), ("early", 2)):
        monkeypatch.setenv(pdl.PDL_ENV, raw)
        assert pdl.pdl_mode(gpu0) == mode and pdl.pdl_mode(gpu1) == 0
        assert pdl.pdl_launch(gpu0) == ({"PDL": mode, "launch_pdl": True} if mode else {"PDL": 0})
    monkeypatch.setattr(pdl, "_triton_has_pdl", lambda: False)  # a Triton without the launch_pdl option
    assert pdl.pdl_mode(gpu0) == 0
