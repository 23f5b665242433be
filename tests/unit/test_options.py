"""The option objects and their one reader: every `GRAPHLINE_*` variable parses into `KernelOptions`, `CommOptions`
or `DriverOptions` (bad values name the variable and the choices), the options are frozen and validated
themselves, they travel inside the configs, and `get_kernel_ops` binds the kernel options into the Triton
`KernelOps` once (checked here without a GPU: the device queries are stubbed)."""
import dataclasses

import pytest
import torch

from actors.coordinator import DeploymentConfig
from actors.environment import OPTION_VARIABLES, options_from_environ
from actors.options import DriverOptions, DriverOptionsError
from actors.rank import RuntimeConfig
from modeling.ops.options import KernelOptions
from parallel.options import CommOptions


def test_defaults_without_any_variable():
    opts = options_from_environ({})
    assert opts == (KernelOptions(), CommOptions(), DriverOptions())
    assert RuntimeConfig().kernels == KernelOptions()
    assert DeploymentConfig().comm == CommOptions() and DeploymentConfig().driver == DriverOptions()


def test_every_variable_reaches_its_field():
    env = {"GRAPHLINE_PDL": "1", "GRAPHLINE_GEMV": "0", "GRAPHLINE_GEMV_ROWS": "3",
           "GRAPHLINE_DECODE_SINGLE_LAUNCH": "0", "GRAPHLINE_DECODE_PREFETCH": "0",
           "GRAPHLINE_COMPILE_THREADS": "2", "GRAPHLINE_PROJECTION_MEASURE": "0", "GRAPHLINE_MOE_ROUTE_KERNEL": "0",
           "GRAPHLINE_MOE_PDL": "0", "GRAPHLINE_MOE_ROUTER_GEMV": "0", "GRAPHLINE_MOE_PAIRS_MAX": "0",
           "GRAPHLINE_MOE_IN_PIECES": "0", "GRAPHLINE_TP_ALLREDUCE": "symm",
           "GRAPHLINE_TP_FUSED_KIND": "pull", "GRAPHLINE_TP_FUSED_NORM": "0",
           "GRAPHLINE_DEEPEP_MAX_TOKENS_PER_RANK": "128",
           "GRAPHLINE_STEP_PATH": "plain", "GRAPHLINE_DRIVER_POLL_S": "0.001", "GRAPHLINE_STEP_TRACE": "1",
           "GRAPHLINE_STEP_PROFILE": "/tmp/prof"}
    assert set(env) == set(OPTION_VARIABLES)
    k, c, d = options_from_environ(env)
    assert k == KernelOptions(pdl="1", gemv=False, gemv_rows=3, decode_single_launch=False, decode_prefetch=False,
                              compile_threads=2,
                              measure_projections=False, moe_route_kernel=False, moe_pdl=False,
                              moe_router_gemv=False, moe_pairs_max=0, moe_in_pieces=False)
    assert c == CommOptions(tp_allreduce="symm", tp_fused_kind="pull", tp_fused_norm=False,
                            deepep_max_tokens_per_rank=128)
    assert d == DriverOptions(step_path="plain", poll_s=0.001, step_trace=True, step_profile="/tmp/prof")


@pytest.mark.parametrize("name,raw,match", [
    ("GRAPHLINE_PDL", "on", r"GRAPHLINE_PDL='on': use 0 \(off\), 1 .* or early"),
    ("GRAPHLINE_DECODE_SINGLE_LAUNCH", "yes", r"GRAPHLINE_DECODE_SINGLE_LAUNCH='yes': use 1 .* or 0"),
    ("GRAPHLINE_DECODE_PREFETCH", "2", r"GRAPHLINE_DECODE_PREFETCH='2': use 1 \(decode attention .* or 0"),
    ("GRAPHLINE_PROJECTION_MEASURE", "no", r"GRAPHLINE_PROJECTION_MEASURE='no': use 1 \(measure .* or 0"),
    ("GRAPHLINE_STEP_PATH", "fast", r"GRAPHLINE_STEP_PATH must be one of .*'fast'"),
    ("GRAPHLINE_DRIVER_POLL_S", "soon", r"GRAPHLINE_DRIVER_POLL_S='soon'"),
    ("GRAPHLINE_DRIVER_POLL_S", "-1", r"GRAPHLINE_DRIVER_POLL_S=-1.0 must be a number of seconds >= 0"),
    ("GRAPHLINE_STEP_TRACE", "true", r"GRAPHLINE_STEP_TRACE='true': use 1 .* or 0"),
    ("GRAPHLINE_MOE_PAIRS_MAX", "all", r"GRAPHLINE_MOE_PAIRS_MAX='all' is not an integer"),
    ("GRAPHLINE_MOE_PAIRS_MAX", "-8", r"GRAPHLINE_MOE_PAIRS_MAX=-8 must be an integer >= 0"),
    ("GRAPHLINE_MOE_IN_PIECES", "on", r"GRAPHLINE_MOE_IN_PIECES='on': use 1 \(MoE experts captured .* or 0"),
])
def test_a_bad_variable_is_named_with_its_choices(name, raw, match):
    with pytest.raises(ValueError, match=match):
        options_from_environ({name: raw})


def test_empty_overrides_mean_unset():
    d = options_from_environ({"GRAPHLINE_STEP_PATH": "", "GRAPHLINE_DRIVER_POLL_S": "", "GRAPHLINE_STEP_PROFILE": ""})
    assert d.driver == DriverOptions()


def test_options_are_frozen_and_checked():
    with pytest.raises(dataclasses.FrozenInstanceError):
        KernelOptions().pdl = "0"
    with pytest.raises(ValueError, match=r"measure_projections \(GRAPHLINE_PROJECTION_MEASURE\) must be a bool"):
        KernelOptions(measure_projections=1)
    with pytest.raises(ValueError, match=r"GRAPHLINE_MOE_PAIRS_MAX=True must be an integer >= 0"):
        KernelOptions(moe_pairs_max=True)
    with pytest.raises(ValueError, match=r"moe_in_pieces \(GRAPHLINE_MOE_IN_PIECES\) must be a bool"):
        KernelOptions(moe_in_pieces=1)
    with pytest.raises(DriverOptionsError, match="GRAPHLINE_STEP_PATH"):
        DriverOptions(step_path="bogus")
    with pytest.raises(ValueError, match="GRAPHLINE_DEEPEP_MAX_TOKENS_PER_RANK"):
        CommOptions(deepep_max_tokens_per_rank=0)


def test_triton_kernel_ops_bind_the_options_once(monkeypatch):
    pytest.importorskip("triton", reason="the Triton backend's modules need triton")
    from modeling.ops import (KernelOps, get_kernel_ops, pdl, triton_attention, triton_gemm, triton_gemm_measure,
                              triton_moe, triton_moe_pairs, triton_router)

    monkeypatch.setattr(pdl, "_INTERPRETED", False)
    monkeypatch.setattr(pdl, "_triton_has_pdl", lambda: True)
    monkeypatch.setattr(pdl, "_device_has_pdl", lambda index: True)  # an sm_90 stand-in: nothing is launched
    dev = torch.device("cuda", 0)
    ops = get_kernel_ops(dev, "triton")
    assert ops.options == KernelOptions() and ops.prologue_norm_max_tokens == 2
    assert ops.linear.func is triton_gemm.linear and ops.linear.keywords == {"pdl": 2, "gemv": 2}
    assert ops.norm_linear.keywords == {"pdl": 2, "gemv": 2}
    assert ops.decode_attention.keywords == {"pdl": 2, "single_launch": True, "prefetch": None}
    assert ops.warm_up_attention.func is triton_attention.warm_up_attention
    assert ops.warm_up_attention.keywords == {"threads": None, "pdl": 2, "single_launch": True, "prefetch": None}
    assert ops.measure_projections.func is triton_gemm_measure.measure_projection_fallbacks
    assert ops.measure_projections.keywords == {"gemv": 2, "pdl": 2}
    rows4 = get_kernel_ops(dev, "triton", KernelOptions(gemv_rows=4))
    assert rows4.prologue_norm_max_tokens == 4 and rows4.norm_linear.keywords == {"pdl": 2, "gemv": 4}
    assert rows4.measure_projections.keywords == {"gemv": 4, "pdl": 2}
    assert ops.moe_route.func is triton_router.route_topk and ops.moe_route.keywords == {"pdl": 2}  # the default
    assert ops.moe_routed.func is triton_moe_pairs.routed_experts_by_size
    assert ops.moe_packed.func is triton_moe.packed_experts
    assert ops.moe_routed.keywords == {"pairs_max": 16, "pdl": 2} and ops.moe_packed.keywords == {"pdl": 2}
    assert ops.moe_router_linear.func is triton_gemm.router_linear
    assert ops.moe_router_linear.keywords == {"pdl": 2, "gemv": 2}
    assert ops.options.moe_in_pieces is True  # the MoE experts captured inside the piecewise graph pieces
    assert get_kernel_ops(dev, "triton", KernelOptions(moe_in_pieces=False)).options.moe_in_pieces is False
    off = get_kernel_ops(dev, "triton", KernelOptions(moe_route_kernel=False, moe_pdl=False, moe_router_gemv=False,
                                                      moe_pairs_max=0))
    assert off.moe_route is None and off.moe_router_linear is None  # torch's routing, cuBLAS's router projection
    assert off.moe_routed.keywords == {"pairs_max": 0, "pdl": 0}  # the grouped experts at every size, without PDL
    assert off.moe_packed.keywords == {"pdl": 0}
    opts = KernelOptions(pdl="1", gemv=False, decode_single_launch=False, decode_prefetch=False, compile_threads=3,
                         moe_route_kernel=True)
    ops = get_kernel_ops(dev, "triton", opts)
    assert ops.options == opts and ops.prologue_norm_max_tokens == 0
    assert ops.linear.keywords == {"pdl": 1, "gemv": 0}
    assert ops.silu_and_mul.keywords == ops.rms_norm.keywords == {"pdl": 1}
    assert ops.decode_attention.keywords == {"pdl": 1, "single_launch": False, "prefetch": False}
    assert ops.warm_up_attention.keywords == {"threads": 3, "pdl": 1, "single_launch": False, "prefetch": False}
    assert ops.measure_projections.keywords == {"gemv": 0, "pdl": 1}
    assert ops.moe_route.keywords == {"pdl": 1}
    off = get_kernel_ops(dev, "triton", KernelOptions(measure_projections=False))
    assert off.measure_projections is KernelOps.measure_projections  # measures nothing, reads no cache
    assert off.measure_projections([(3072, 1024)], dev, torch.bfloat16) == {}
    assert get_kernel_ops(dev, "triton", KernelOptions(pdl="0")).linear.keywords["pdl"] == 0


def test_the_torch_backend_keeps_the_options_it_was_given():
    from modeling.ops import get_kernel_ops

    opts = KernelOptions(gemv=False)
    assert get_kernel_ops("cpu", "auto", opts).options == opts


def test_models_wider_than_the_gemv_limit_run_without_it():
    """The decode GEMV serves models up to GEMV_MAX_HIDDEN wide; a wider one's rank binds its kernels with it off
    (the option itself stays as configured, for narrower models on the same deployment)."""
    from modeling.config import PRESETS
    from modeling.ops.options import GEMV_MAX_HIDDEN

    on = KernelOptions()
    assert on.for_model(GEMV_MAX_HIDDEN) == dataclasses.replace(on, gemv_rows=2)
    assert on.for_model(1024) == dataclasses.replace(on, gemv_rows=4)
    told = KernelOptions(gemv_rows=3)
    assert told.for_model(1024) is told and told.for_model(GEMV_MAX_HIDDEN) is told
    assert on.for_model(GEMV_MAX_HIDDEN + 1) == dataclasses.replace(on, gemv=False)
    off = KernelOptions(gemv=False, pdl="1")
    assert off.for_model(1024) is off and off.for_model(4096) is off
    wide = {name for name, c in PRESETS.items() if c.hidden_size > GEMV_MAX_HIDDEN}
    assert {"qwen3-8b", "qwen3-14b"} <= wide and not {"qwen3-0.6b", "qwen3-1.7b", "qwen3-30b-a3b"} & wide


def test_a_rank_binds_its_kernels_with_the_options_for_its_model(monkeypatch):
    """`RankRuntime.load_model` asks for the kernel ops with `KernelOptions.for_model(hidden_size)`: a real rank on
    CPU of a 4096-wide model (the tiny preset widened; 1 layer) binds them with the GEMV off."""
    from actors import rank as rank_mod
    from modeling.config import PRESETS
    from parallel.context import ParallelContext

    monkeypatch.setitem(PRESETS, "qwen3-tiny-wide", dataclasses.replace(PRESETS["qwen3-tiny"], hidden_size=4096,
                                                                        num_layers=1))
    seen = []
    real = rank_mod.get_kernel_ops
    monkeypatch.setattr(rank_mod, "get_kernel_ops", lambda dev, backend, opts: seen.append(opts) or real(dev, backend,
                                                                                                        opts))
    for model in ("qwen3-tiny", "qwen3-tiny-wide"):
        rt = rank_mod.RankRuntime(RuntimeConfig(model=model, device="cpu", num_kv_blocks=16, max_model_len=128),
                                  ParallelContext(), torch.device("cpu"))
        rt.load_model()
        assert rt.model.kernels.options == seen[-1]
    assert [o.gemv for o in seen] == [True, False]
