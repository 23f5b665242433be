"""Closed-loop scheduling simulation on the toy executor: how many engine steps a request waits for its first
token, with and without overlap (`EngineConfig.overlap`). Model-free and timing-free: it shows what the
scheduling policy does (admission delay in rounds, rounds scheduled ahead), not device speed.

    python -m bench.engine_sim --clients 16,64 --requests-per-client 4 --max-tokens 96,128
"""
from __future__ import annotations

import argparse

import numpy as np

from engine import EngineConfig, LLMEngine
from engine.testing import PagedToyExecutor


def simulate(clients: int, per_client: int, prompt_len: int, max_tokens: tuple[int, int], overlap: bool,
             overlap_max_seqs: int, seed: int = 0) -> dict:
    """Every client keeps one request in flight and sends its next one the step its previous one finishes."""
    ex = PagedToyExecutor(num_kv_blocks=8000, block_size=16, max_model_len=prompt_len + max_tokens[1] + 1)
    eng = LLMEngine(ex, EngineConfig(max_num_seqs=256, max_num_batched_tokens=2048, overlap=overlap,
                                     overlap_max_seqs=overlap_max_seqs))
    rng = np.random.default_rng(seed)
    left, added, first, owner, step = {c: per_client for c in range(clients)}, {}, {}, {}, 0

    def add(c: int) -> None:
        req = eng.make_request(rng.integers(0, 97, prompt_len).tolist(),
                               max_tokens=int(rng.integers(max_tokens[0], max_tokens[1] + 1)))
        rid = eng.add_request(req)
        added[rid], owner[rid] = step, c
        left[c] -= 1

    for c in range(clients):
        add(c)
    while eng.has_unfinished():
        outs = eng.step()
        step += 1
        for o in outs:
            if o.request_id not in first and o.new_token_ids:
                first[o.request_id] = step
            if o.finished and left[owner[o.request_id]] > 0:
                add(owner[o.request_id])
    waits = sorted(first[r] - added[r] for r in added)
    return {"steps": step, "rounds_ahead": eng.counters["rounds_ahead"], "first_token_steps_median":
            waits[len(waits) // 2], "first_token_steps_p99": waits[int(0.99 * (len(waits) - 1))],
            "first_token_steps_max": waits[-1]}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clients", default="16,64")
    p.add_argument("--requests-per-client", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-tokens", default="96,128", help="range of max_tokens per request (lo,hi)")
    p.add_argument("--overlap-max-seqs", type=int, default=32)
    args = p.parse_args(argv)
    lo, hi = (int(x) for x in args.max_tokens.split(","))
    print("clients overlap  steps  rounds ahead  first-token steps: median  p99  max")
    for clients in (int(x) for x in args.clients.split(",")):
        for overlap in (False, True):
            r = simulate(clients, args.requests_per_client, args.prompt_len, (lo, hi), overlap, args.overlap_max_seqs)
            print(f"{clients:7d} {str(overlap):7s} {r['steps']:6d} {r['rounds_ahead']:13d} "
                  f"{r['first_token_steps_median']:26d} {r['first_token_steps_p99']:4d} {r['first_token_steps_max']:4d}")


if __name__ == "__main__":
    main()
