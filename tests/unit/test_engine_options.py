"""Engine options from the command line (`launch.options.engine_config`): the chunked-prefill budget defaults (512
on CPU, 2048 on GPUs, capped by the largest piecewise bucket), `--no-chunked-prefill`, `--no-prefix-caching`; and
`engine/` stays free of torch and `modeling` (a fresh interpreter imports the whole engine package)."""
from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from launch.options import LaunchError, add_model_args, engine_config


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_model_args(p)
    return p.parse_args(list(argv))


def test_chunked_prefill_and_prefix_caching_are_on_by_default_with_device_budgets():
    cpu = engine_config(_args("--device", "cpu"))
    assert cpu.enable_chunked_prefill and cpu.enable_prefix_caching and cpu.max_num_batched_tokens == 512
    assert engine_config(_args("--device", "cpu", "--pcg-max-tokens", "256")).max_num_batched_tokens == 256
    assert engine_config(_args("--device", "cpu", "--pcg-max-tokens", "0")).max_num_batched_tokens == 512
    gpu = engine_config(_args("--device", "cuda"))
    assert gpu.max_num_batched_tokens == 2048  # the GPU's piecewise buckets go to 4096
    assert engine_config(_args("--device", "cuda", "--max-num-batched-tokens", "1024")).max_num_batched_tokens == 1024
    with pytest.raises(LaunchError, match="max-num-batched-tokens"):
        engine_config(_args("--device", "cpu", "--max-num-batched-tokens", "0"))


def test_the_switches_turn_them_off():
    off = engine_config(_args("--device", "cpu", "--no-chunked-prefill", "--no-prefix-caching"))
    assert not off.enable_chunked_prefill and not off.enable_prefix_caching
    assert off.max_num_batched_tokens is None  # the engine then prefills whole prompts (budget >= max_model_len)
    from engine import LLMEngine
    from engine.testing import PagedToyExecutor

    eng = LLMEngine(PagedToyExecutor(max_model_len=256), off)
    assert not eng.sched_config.chunked and not eng.schedulers[0].blocks.enable_caching


def test_the_engine_package_imports_neither_torch_nor_modeling():
    code = ("import sys, engine, engine.block_manager, engine.chunking, engine.scheduler, engine.samples, "
            "engine.testing; bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith(('torch.', "
            "'modeling'))); print(bad); sys.exit(1 if bad else 0)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
