"""Greedy tokens of fixed prompts over many decode steps on one rank: a before/after equality check across commits.

    python -m bench.greedy_tokens --model qwen3-0.6b --steps 256 --out /tmp/after.json        # GPU, graphs on
    (cd old-checkout && PYTHONPATH=$PWD python -m bench.greedy_tokens ... --out /tmp/before.json)
    python -m bench.greedy_tokens --compare /tmp/before.json /tmp/after.json

One `RankRuntime` (every decode and prefill graph captured), `--batch` random prompts of 16..200 tokens (seeded),
one prefill step, then `--steps - 1` greedy decode steps of the whole batch (CUDA graphs and LM-head graphs), the
batch's shape fixed, so both commits run identical shapes. Uses only the rank API both sides share
(`RankRuntime`, `StepBatch.from_sequences`). `--compare` exits 1 on any difference, naming the first.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np


def run(model: str, steps: int, batch: int, device: str) -> dict:
    import torch

    from actors.batch import StepBatch
    from actors.rank import RankRuntime, RuntimeConfig
    from parallel.context import ParallelContext

    cfg = RuntimeConfig(model=model, device=device, num_kv_blocks=1024, max_model_len=4096)
    dev = torch.device("cuda", 0) if device == "cuda" else torch.device("cpu")
    rt = RankRuntime(cfg, ParallelContext(), dev)
    rt.load_model()
    rt.allocate_kv_cache()
    rt.build_runner()
    rt.capture_all()
    rng = np.random.default_rng(19)
    vocab = rt.model_config.vocab_size
    prompts = [rng.integers(1, vocab, int(rng.integers(16, 200))).tolist() for _ in range(batch)]
    bs, nxt, tables = cfg.block_size, 1, []
    for p in prompts:
        n = -(-(len(p) + steps) // bs)
        tables.append(list(range(nxt, nxt + n)))
        nxt += n
    if nxt > 1024:
        raise SystemExit(f"needs {nxt} KV blocks; lower --steps or --batch")
    out = [[int(t)] for t in rt.execute(StepBatch.from_sequences(prompts, [0] * batch, tables))]
    for j in range(steps - 1):
        b = StepBatch.from_sequences([[o[-1]] for o in out], [len(p) + j for p in prompts], tables)
        for o, t in zip(out, rt.execute(b).tolist()):
            o.append(int(t))
    snap = rt.runner.stats.snapshot()["steps"]
    return {"model": model, "steps": steps, "batch": batch, "prompt_lens": [len(p) for p in prompts],
            "tokens": out, "runner_steps": snap}


def compare(a: dict, b: dict) -> int:
    if a["prompt_lens"] != b["prompt_lens"]:
        print("the two runs used different prompts")
        return 1
    for i, (x, y) in enumerate(zip(a["tokens"], b["tokens"])):
        if x != y:
            j = next(k for k, (u, v) in enumerate(zip(x, y)) if u != v)
            print(f"sequence {i} differs first at step {j}: {x[j]} vs {y[j]}")
            return 1
    print(f"identical: {len(a['tokens'])} sequences x {len(a['tokens'][0])} greedy tokens")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--steps", type=int, default=256)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default=None)
    ap.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"))
    args = ap.parse_args(argv)
    if args.compare:
        return compare(*(json.loads(Path(p).read_text()) for p in args.compare))
    res = run(args.model, args.steps, args.batch, args.device)
    print(f"{res['batch']} sequences x {res['steps']} tokens; runner steps {res['runner_steps']}")
    if args.out:
        Path(args.out).write_text(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
