"""`graphline demo`: greedy generation on a random-weight preset, printing tokens and time per step.

Runs single-process on the GPU when present (through the graph runner), else on the CPU.
"""
from __future__ import annotations

import argparse
import time

import numpy as np


def add_demo_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="generate with a random-weight preset (no download, CPU or GPU)")
    p.add_argument("--model", default="qwen3-tiny", help="preset name or HF checkpoint directory")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--prompt-len", type=int, default=12)
    p.add_argument("--device", default="auto")
    p.add_argument("--eager", action="store_true", help="never use CUDA graphs")
    p.set_defaults(func=run_demo)


def run_demo(args: argparse.Namespace) -> int:
    from actors.environment import options_from_environ
    from actors.local import LocalExecutor
    from actors.rank import RuntimeConfig
    from graphrunner.config import GraphRunnerConfig

    graph = GraphRunnerConfig(eager_mode=args.eager, max_decode_batch=max(8, args.batch), pcg_max_tokens=0)
    cfg = RuntimeConfig(model=args.model, device=args.device, graph=graph, num_kv_blocks=64, block_size=16,
                        max_model_len=args.prompt_len + args.max_tokens + 16,
                        kernels=options_from_environ().kernels)
    t0 = time.perf_counter()
    ex = LocalExecutor(cfg)
    ex.start()
    print(f"model {args.model} on {ex.runtime.device}: ready in {time.perf_counter() - t0:.2f} s")
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, ex.runtime.model_config.vocab_size, args.prompt_len).tolist() for _ in range(args.batch)]
    result = ex.greedy(prompts, args.max_tokens)
    for i, toks in enumerate(result.tokens):
        print(f"sequence {i}: prompt {prompts[i]} -> {toks}")
    steps = result.step_seconds
    print(f"prefill {steps[0] * 1e3:.2f} ms; decode {np.mean(steps[1:]) * 1e3:.3f} ms/step "
          f"(median {np.median(steps[1:]) * 1e3:.3f} ms over {len(steps) - 1} steps)")
    print("runner steps per path:", ex.runtime.runner.stats.snapshot().get("steps"))
    return 0
