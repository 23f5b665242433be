"""`graphline generate`: offline generation through the engine (continuous batching, no HTTP).

Prompts as token ids (`--prompt-ids 1,2,3`, repeatable), text (`--prompt`, needs a checkpoint
tokenizer) or random (`--random N --prompt-len L`). Prints one line per prompt, or JSON.
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np

from launch.options import (add_model_args, build_executor, checkpoint_generation_defaults, engine_config,
                            load_tokenizer, start_executor)


def add_generate_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="offline generation (continuous batching through the engine)")
    add_model_args(p, executor_default="auto")
    g = p.add_argument_group("prompts and sampling")
    g.add_argument("--prompt-ids", action="append", default=[], help="comma-separated token ids (repeatable)")
    g.add_argument("--prompt", action="append", default=[], help="text (needs a checkpoint with a tokenizer)")
    g.add_argument("--random", type=int, default=0, help="this many random prompts")
    g.add_argument("--prompt-len", type=int, default=16)
    g.add_argument("--max-tokens", type=int, default=16)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--sampling-seed", type=int, default=None)
    g.add_argument("--stop-token-ids", default="", help="comma-separated")
    g.add_argument("--ignore-eos", action="store_true", help="do not stop at the checkpoint's end-of-sequence ids")
    g.add_argument("--json", action="store_true", help="print one JSON document")
    p.set_defaults(func=run_generate)


def _ids(s: str) -> list[int]:
    return [int(x) for x in s.replace(" ", "").split(",") if x]


def run_generate(args: argparse.Namespace) -> int:
    from engine.llm_engine import LLMEngine
    from engine.request import RequestError
    from engine.sampling_params import SamplingParams

    executor, kind = build_executor(args)
    try:
        t0 = time.perf_counter()
        start_executor(executor, args)
        ready = time.perf_counter() - t0
        eos = checkpoint_generation_defaults(args.model, executor.model_config).get("eos_token_id", ())
        engine = LLMEngine(executor, engine_config(args, eos))
        prompts = [_ids(s) for s in args.prompt_ids]
        if args.prompt:
            tok = load_tokenizer(args.model)
            if tok is None:
                print(f"graphline generate: {args.model} has no tokenizer; use --prompt-ids")
                return 2
            prompts += [list(tok.encode(t)) for t in args.prompt]
        rng = np.random.default_rng(0)
        prompts += [rng.integers(1, engine.vocab_size, args.prompt_len).tolist() for _ in range(args.random)]
        if not prompts:
            prompts = [rng.integers(1, engine.vocab_size, args.prompt_len).tolist()]
        t1 = time.perf_counter()
        try:
            sampling = SamplingParams(args.temperature, args.top_k, args.top_p, seed=args.sampling_seed,
                                      ignore_eos=args.ignore_eos)
            outs = engine.generate(prompts, sampling, args.max_tokens, _ids(args.stop_token_ids))
        except RequestError as exc:
            print(f"graphline generate: bad request: {exc}")
            return 2
        gen_s = time.perf_counter() - t1
        ntok = sum(len(o.token_ids) for o in outs)
        if args.json:
            print(json.dumps({"executor": kind, "ready_s": ready, "generate_s": gen_s, "outputs": [
                {"prompt": list(o.prompt_token_ids), "token_ids": o.token_ids,
                 "finish_reason": o.finish_reason.value} for o in outs]}))
        else:
            for i, o in enumerate(outs):
                print(f"[{i}] {list(o.prompt_token_ids)} -> {o.token_ids} ({o.finish_reason.value})")
            print(f"{len(outs)} prompts, {ntok} tokens in {gen_s:.3f} s ({ntok / max(gen_s, 1e-9):.1f} tok/s); "
                  f"executor {kind} ready in {ready:.2f} s; preemptions {engine.stats()['preemptions']}")
        return 0
    finally:
        shutdown = getattr(executor, "shutdown", None)
        if shutdown is not None:
            shutdown()
