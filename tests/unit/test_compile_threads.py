"""Kernel warm-up plumbing on the CPU: the compile-thread count (`KernelOptions.compile_threads`, from
`GRAPHLINE_COMPILE_THREADS`; bad values name the variable), calls that really run side by side, failures raised
after every call ended, and the one-thread path in order."""
import os
import threading

import pytest
import torch

from actors.environment import options_from_environ
from modeling.ops.options import KernelOptions
from modeling.ops.warm_up import compile_threads, run_side_by_side


def test_default_uses_up_to_eight_cores():
    assert options_from_environ({}).kernels.compile_threads is None
    assert compile_threads() == compile_threads(None) == max(1, min(8, os.cpu_count() or 1))


def test_variable_sets_the_count():
    n = options_from_environ({"GRAPHLINE_COMPILE_THREADS": "3"}).kernels.compile_threads
    assert n == 3 and compile_threads(n) == 3


@pytest.mark.parametrize("raw", ["0", "-2", "four", ""])
def test_bad_values_are_refused_by_name(raw):
    with pytest.raises(ValueError, match="GRAPHLINE_COMPILE_THREADS"):
        options_from_environ({"GRAPHLINE_COMPILE_THREADS": raw})


@pytest.mark.parametrize("value", [0, -2, True, 2.0])
def test_bad_option_values_are_refused_by_name(value):
    with pytest.raises(ValueError, match="GRAPHLINE_COMPILE_THREADS"):
        KernelOptions(compile_threads=value)


def test_calls_run_side_by_side_in_the_callers_inference_mode():
    meet = threading.Barrier(3, timeout=10)  # passes only when three calls run at once
    seen = []

    def call():
        meet.wait()
        seen.append((threading.current_thread().name, torch.is_inference_mode_enabled()))

    with torch.inference_mode():
        run_side_by_side([call, call, call], threads=3)
    assert len(seen) == 3 and all(inference for _, inference in seen)
    assert all(name.startswith("kernel-warm-up") for name, _ in seen)


def test_first_failure_is_raised_after_every_call_ended():
    done = []

    def bad():
        raise RuntimeError("variant 3 failed to compile")

    def slow_ok():
        threading.Event().wait(0.2)
        done.append(1)

    with pytest.raises(RuntimeError, match="variant 3"):
        run_side_by_side([bad, slow_ok, slow_ok], threads=3)
    assert done == [1, 1]


def test_one_thread_runs_in_order_on_the_caller():
    order = []
    run_side_by_side([lambda i=i: order.append((i, threading.current_thread() is threading.main_thread()))
                      for i in range(4)], threads=1)
    assert order == [(0, True), (1, True), (2, True), (3, True)]
