"""Batched device sampler (`modeling/sampler`) against greedy argmax, graph-captured, side by side.

    python -m bench.sampler_bench --out artifacts/sampler_bench.json

Per batch size (default 1, 8, 64, 256) and bf16 logits `[B, vocab]` (default 151936, Qwen3), microseconds per
call inside one CUDA graph of `--calls` back-to-back calls (CUDA events over `--replays` replays): greedy
`argmax`, and the sampler with every row at temperature 1 plus top_p 0.9 / top_k 50 / min_p 0.1 / top-5 raw
logprobs / top-20 raw logprobs / nothing else / temperature 0 (the sampler's greedy) / penalties and a logit bias,
and Qwen3's generation defaults (temperature 0.6, top_k 20, top_p 0.95), each in the smallest variant that serves
it.
`--logits` picks the rows: `model` (a long tail holding most of the mass at temperature 1, as random-weight
models give: top-p's nucleus runs to many thousands of ids), `zipf` (log-probabilities -1.5 ln(rank), ranks
shuffled: entropy 3.2 nats, top-1 0.38, a nucleus of 57 ids at top_p 0.9 and 218 at 0.95, nearer a trained
model's next-token distribution).
`--tile-skip both` adds each case on the plain path (`triton_sampler.SAMPLE_SKIP` off: the noise of every tile
within reach computed; the same tokens); `--gumbel-step` / `--gumbel-warps` set the Gumbel-max kernel's ids per
step and warps. Prints the ratio to argmax and the added microseconds; the JSON holds every number.
"""
from __future__ import annotations

import argparse
from typing import Callable

import torch

from bench.common import machine, write_json
from modeling.sampler import HostBatch, RowSpec, SamplerParams, SamplerVariant, sample
from modeling.sampler import triton_sampler as ts

CASES: dict[str, tuple[dict, SamplerVariant, int]] = {
    "T=1 top_p=0.9": ({"temperature": 1.0, "top_p": 0.9}, SamplerVariant(top_p=True), 0),
    "T=1 top_k=50": ({"temperature": 1.0, "top_k": 50}, SamplerVariant(top_k=True), 0),
    "T=1 min_p=0.1": ({"temperature": 1.0, "min_p": 0.1}, SamplerVariant(), 0),
    "T=1 top-5 logprobs": ({"temperature": 1.0}, SamplerVariant(), 5),
    "T=1 top-20 logprobs": ({"temperature": 1.0}, SamplerVariant(), 20),
    "T=1": ({"temperature": 1.0}, SamplerVariant(), 0),
    "T=0 (sampler)": ({"temperature": 0.0}, SamplerVariant(), 0),
    "T=1 top_k=200": ({"temperature": 1.0, "top_k": 200}, SamplerVariant(top_k=True, large_top_k=True), 0),
    "T=1 top_k=50 top_p=0.9": ({"temperature": 1.0, "top_k": 50, "top_p": 0.9}, SamplerVariant(top_k=True, top_p=True), 0),
    "Qwen3 default (T=0.6 top_k=20 top_p=0.95)": ({"temperature": 0.6, "top_k": 20, "top_p": 0.95},
                                                  SamplerVariant(top_k=True, top_p=True), 0),
    "T=1 penalties+bias": ({"temperature": 1.0, "repetition_penalty": 1.1, "frequency_penalty": 0.2,
                            "prompt_token_ids": tuple(range(100, 140)), "output_token_ids": tuple(range(7, 20)),
                            "logit_bias": {5: 2.0}}, SamplerVariant(processed=True), 0),
}


def graph_us(fn: Callable[[], object], calls: int, replays: int) -> float:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()  # compile / warm up outside the capture
        side.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=side):
            for _ in range(calls):
                fn()
    torch.cuda.current_stream().wait_stream(side)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / (replays * calls)


def logits_like_a_model(b: int, vocab: int, device: torch.device) -> torch.Tensor:
    """bf16 logits with a long tail and a few strong candidates per row (like an LM head's)."""
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(b, vocab, device=device, generator=g) * 2.0
    top = torch.randint(0, vocab, (b, 8), device=device, generator=g)
    x.scatter_add_(1, top, torch.linspace(12, 4, 8, device=device).expand(b, 8).contiguous())
    return x.bfloat16()


def logits_zipf(b: int, vocab: int, device: torch.device, s: float = 1.5) -> torch.Tensor:
    """bf16 logits -s ln(rank) over a random permutation of the ranks 1..vocab per row."""
    g = torch.Generator(device=device).manual_seed(0)
    ranks = torch.argsort(torch.rand(b, vocab, device=device, generator=g), dim=1).float() + 1.0
    return (-s * ranks.log()).bfloat16()


LOGITS = {"model": logits_like_a_model, "zipf": logits_zipf}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,8,64,256")
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--calls", type=int, default=10, help="calls per captured graph")
    ap.add_argument("--replays", type=int, default=50)
    ap.add_argument("--cases", default=",".join(CASES), help="comma-separated subset of: " + ", ".join(CASES))
    ap.add_argument("--logits", default="model", choices=sorted(LOGITS), help="the rows' logits (see above)")
    ap.add_argument("--tile-skip", default="on", choices=("on", "off", "both"),
                    help="the Gumbel-max kernel's tile skip (both: each case with and without it)")
    ap.add_argument("--gumbel-step", type=int, default=ts.SAMPLE_BLOCK, help="ids per step of the Gumbel-max kernel")
    ap.add_argument("--gumbel-warps", type=int, default=ts.SAMPLE_WARPS)
    ap.add_argument("--out", default=None, help="JSON output path")
    args = ap.parse_args(argv)
    ts.SAMPLE_BLOCK, ts.SAMPLE_WARPS = args.gumbel_step, args.gumbel_warps
    skips = {"on": (True,), "off": (False,), "both": (True, False)}[args.tile_skip]
    dev = torch.device("cuda")
    batches = [int(b) for b in args.batches.split(",")]
    cases = [c.strip() for c in args.cases.split(",")]
    params = SamplerParams(max(batches), dev, max_penalty_tokens=64)
    rows = []
    for b in batches:
        logits = LOGITS[args.logits](b, args.vocab, dev)
        row = {"batch": b, "argmax_us": graph_us(lambda: logits.argmax(-1), args.calls, args.replays)}
        for name in cases:
            fields, variant, n = CASES[name]
            specs = [RowSpec(seed=1000 + i, position=50 + i, **fields) for i in range(b)]
            params.load(HostBatch.from_rows(specs, vocab_size=args.vocab, max_bias=32, max_ban=8,
                                            max_penalty_tokens=64))
            torch.cuda.synchronize()
            for skip in skips:
                ts.SAMPLE_SKIP = skip
                key = name if skip or len(skips) == 1 else f"{name} [no skip]"
                row[key] = graph_us(lambda: sample(logits, params, num_logprobs=n, variant=variant), args.calls,
                                    args.replays)
            ts.SAMPLE_SKIP = True
        rows.append(row)
        logits = None  # free it before the next batch size
    cases = [c for c in rows[0] if c not in ("batch", "argmax_us")]
    head = f"{'batch':>5} {'argmax us':>9} | " + " | ".join(f"{c:>24}" for c in cases)
    print(f"sampler vs argmax, bf16 {args.logits} logits [B, {args.vocab}], us per call in a graph of "
          f"{args.calls} calls (ratio to argmax, +us)")
    print(head)
    for r in rows:
        cells = [f"{r[c]:7.1f} ({r[c] / r['argmax_us']:4.1f}x +{r[c] - r['argmax_us']:6.1f})" for c in cases]
        print(f"{r['batch']:>5} {r['argmax_us']:9.1f} | " + " | ".join(f"{c:>24}" for c in cells))
    write_json(args.out, {"machine": machine(), "logits": args.logits, "vocab": args.vocab, "calls": args.calls,
                          "replays": args.replays, "tile_skip": args.tile_skip, "gumbel_step": args.gumbel_step,
                          "gumbel_warps": args.gumbel_warps, "rows": rows})


if __name__ == "__main__":
    main()
