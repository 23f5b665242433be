"""Chunked prefill and prefix caching, measured side by side in one run through the engine (`LLMEngine` over the
local executor or the Ray coordinator, configured by the same options as `graphline serve`).

    python -m bench.prefill_bench --model qwen3-0.6b                                   # one H200, local executor
    python -m bench.prefill_bench --model qwen3-0.6b --executor ray                    # through the coordinator
    python -m bench.prefill_bench --smoke                                              # CPU, qwen3-tiny, seconds

Scenarios (every engine is fresh, over the one started executor; prompts are random, so nothing hits the cache
unless a scenario means it to):
- ttft: time to first token of one request alone at 512 and 2048 prompt tokens, chunked and unchunked;
- prefix hit: a 2000-token prefix cached by an earlier request, then prefix + 16 new tokens: TTFT with the hit
  against the same request with prefix caching off;
- throughput: 128 requests of 512 prompt + 128 output tokens at once, prefix caching on (no hits: the cost of
  hashing and lookup) and off, in alternating rounds (medians);
- clients: 64 closed-loop clients (2 requests each, starts staggered) of 2000 prompt + 128 output tokens: TTFT
  p50 / p99, TPOT p99 (per request) and the p99 gap between a request's tokens, chunked against unchunked;
- decode only: 64 requests of 2000-token context decoding together: the mean step time of pure decode steps
  (the TPOT a decode batch of 64 gets when no prefill interrupts it).
Prints a table and writes JSON (`--out`, default artifacts/prefill_bench.json).
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Optional

import numpy as np

from bench.common import write_json


@dataclasses.dataclass(frozen=True)
class Sizes:
    short: int = 512
    long: int = 2048
    prefix: int = 2000
    suffix: int = 16
    tput_requests: int = 128
    tput_prompt: int = 512
    tput_rounds: int = 7
    output: int = 128
    clients: int = 64
    client_prompt: int = 2000
    client_rounds: int = 2
    stagger_s: float = 0.05
    repeats: int = 5


SMOKE = Sizes(short=48, long=120, prefix=100, suffix=16, tput_requests=8, tput_prompt=48, tput_rounds=2, output=8, clients=4,
              client_prompt=100, client_rounds=2, stagger_s=0.0, repeats=2)


def _pct(xs: list[float], q: float) -> Optional[float]:
    return float(np.percentile(xs, q)) if xs else None


class Driver:
    """Runs requests through one engine: arrivals, steps, per-token times (monotonic seconds)."""

    def __init__(self, engine: Any, vocab: int, seed: int = 0):
        self.engine = engine
        self.vocab = vocab
        self.rng = np.random.default_rng(seed)
        self.token_times: dict[str, list[float]] = {}
        self.finished: dict[str, Any] = {}
        self.decode_steps: list[float] = []  # seconds of steps in which every DP rank decoded
        engine.on_step = self._on_step

    def _on_step(self, info: Any) -> None:
        if all(k in (None, "decode") for k in info.kinds):
            self.decode_steps.append(info.seconds / info.num_steps)

    def prompt(self, n: int) -> list[int]:
        return self.rng.integers(1, self.vocab, n).tolist()

    def add(self, prompt: list[int], max_tokens: int) -> str:
        from engine import SamplingParams

        req = self.engine.make_request(prompt, SamplingParams(temperature=0.0, ignore_eos=True), max_tokens)
        self.token_times[req.request_id] = []
        return self.engine.add_request(req)

    def step(self) -> list[str]:
        done = []
        for out in self.engine.step():
            now = time.monotonic()
            self.token_times[out.request_id].extend([now] * len(out.new_token_ids))
            if out.finished:
                self.finished[out.request_id] = out
                done.append(out.request_id)
        return done

    def drain(self) -> None:
        while self.engine.has_unfinished():
            self.step()

    def run_one(self, prompt: list[int], max_tokens: int) -> Any:
        rid = self.add(prompt, max_tokens)
        self.drain()
        return self.finished[rid]

    def latency(self, ids: list[str]) -> dict:
        outs = [self.finished[i] for i in ids]
        ttft = [o.time_to_first_token for o in outs if o.time_to_first_token is not None]
        tpot = [o.time_per_output_token for o in outs if o.time_per_output_token is not None]
        gaps = [b - a for i in ids for a, b in zip(self.token_times[i], self.token_times[i][1:]) if b > a]
        return {"requests": len(outs), "ttft_p50_ms": _ms(_pct(ttft, 50)), "ttft_p99_ms": _ms(_pct(ttft, 99)),
                "tpot_p50_ms": _ms(_pct(tpot, 50)), "tpot_p99_ms": _ms(_pct(tpot, 99)),
                "gap_p99_ms": _ms(_pct(gaps, 99)), "gap_max_ms": _ms(max(gaps) if gaps else None)}


def _ms(s: Optional[float]) -> Optional[float]:
    return None if s is None else round(1000 * s, 3)


def scenario_ttft(make, sizes: Sizes) -> dict:
    out = {}
    for chunked in (True, False):
        drv = make(chunked=chunked)
        for n in (sizes.short, sizes.long):
            ttft = [drv.run_one(drv.prompt(n), 1).time_to_first_token for _ in range(sizes.repeats)]
            out[f"{'chunked' if chunked else 'unchunked'}_{n}_ms"] = _ms(statistics.median(ttft))
    return out


def scenario_prefix_hit(make, sizes: Sizes) -> dict:
    out = {}
    for caching in (True, False):
        drv = make(caching=caching)
        prefix = drv.prompt(sizes.prefix)
        drv.run_one(prefix + drv.prompt(sizes.suffix), 1)  # computes (and, with caching, registers) the prefix
        ttft = [drv.run_one(prefix + drv.prompt(sizes.suffix), 1).time_to_first_token for _ in range(sizes.repeats)]
        out[f"{'hit' if caching else 'no_cache'}_ms"] = _ms(statistics.median(ttft))
        if caching:
            out["hit_rate"] = round(drv.engine.stats()["prefix_cache"]["hit_rate"], 4)
    return out


def scenario_throughput(make, sizes: Sizes) -> dict:
    """Rounds alternate on, off, on, off ... after one discarded warm-up round, so drift in the host or the device
    falls on both settings alike; each setting reports its median round and every round's rate, and the median of
    the rounds' paired ratios (on over the off round right after it)."""
    def one_round(caching: bool) -> tuple[float, float]:
        drv = make(caching=caching)
        ids = [drv.add(drv.prompt(sizes.tput_prompt), sizes.output) for _ in range(sizes.tput_requests)]
        t0 = time.monotonic()
        drv.drain()
        wall = time.monotonic() - t0
        gen = sum(len(drv.finished[i].token_ids) for i in ids)
        return gen / wall, (gen + sizes.tput_requests * sizes.tput_prompt) / wall

    one_round(True)
    rounds: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
    for _ in range(sizes.tput_rounds):
        for caching in (True, False):
            rounds[caching].append(one_round(caching))
    out: dict[str, Any] = {"rounds": sizes.tput_rounds}
    for caching, got in rounds.items():
        key = "cache_on_no_hits" if caching else "cache_off"
        out[f"{key}_output_tok_s"] = round(statistics.median(g[0] for g in got), 1)
        out[f"{key}_total_tok_s"] = round(statistics.median(g[1] for g in got), 1)
        out[f"{key}_rounds_output_tok_s"] = [round(g[0], 1) for g in got]
    out["on_over_off"] = round(out["cache_on_no_hits_output_tok_s"] / out["cache_off_output_tok_s"], 4)
    out["on_over_off_paired_median"] = round(statistics.median(a[0] / b[0] for a, b in zip(rounds[True], rounds[False])),
                                             4)
    return out


def scenario_clients(make, sizes: Sizes, budgets: tuple[int, ...] = ()) -> dict:
    """Chunked at the engine's budget, unchunked, then chunked at each of `budgets` (tokens per step; keys
    `chunked_<budget>`), one after another over the same executor."""
    out = {}
    for chunked, budget in [(True, None), (False, None)] + [(True, b) for b in budgets]:
        drv = make(chunked=chunked, budget=budget)
        t0 = time.monotonic()
        starts = [t0 + i * sizes.stagger_s for i in range(sizes.clients)]
        left = [sizes.client_rounds] * sizes.clients
        current: dict[str, int] = {}
        ids: list[str] = []
        while any(left) or drv.engine.has_unfinished():
            now = time.monotonic()
            for c in range(sizes.clients):
                if left[c] and c not in current.values() and now >= starts[c]:
                    rid = drv.add(drv.prompt(sizes.client_prompt), sizes.output)
                    current[rid] = c
                    ids.append(rid)
                    left[c] -= 1
            if not drv.engine.has_unfinished():
                time.sleep(0.001)
                continue
            for rid in drv.step():
                current.pop(rid, None)
        key = ("chunked" if budget is None else f"chunked_{budget}") if chunked else "unchunked"
        out[key] = {**drv.latency(ids), "wall_s": round(time.monotonic() - t0, 3)}
    return out


def scenario_decode_only(make, sizes: Sizes) -> dict:
    drv = make(chunked=True)
    for _ in range(sizes.clients):
        drv.add(drv.prompt(sizes.client_prompt), sizes.output)
    drv.decode_steps.clear()
    drv.drain()
    steps = drv.decode_steps[len(drv.decode_steps) // 4:]  # every request decodes by then (prefills came first)
    return {"batch": sizes.clients, "context": sizes.client_prompt, "tpot_mean_ms": _ms(statistics.mean(steps)),
            "tpot_p99_ms": _ms(_pct(steps, 99)), "steps": len(steps)}


def main(argv: Optional[list[str]] = None) -> dict:
    from launch.options import add_model_args, build_executor, engine_config, start_executor

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    add_model_args(p, executor_default="local")
    p.add_argument("--smoke", action="store_true", help="tiny sizes on CPU (qwen3-tiny): a check that it runs")
    p.add_argument("--scenarios", default="ttft,prefix,throughput,clients,decode")
    p.add_argument("--budgets", default="",
                   help="comma list: the clients scenario also runs chunked at each of these step budgets (tokens)")
    p.add_argument("--out", default=str(Path("artifacts") / "prefill_bench.json"))
    args = p.parse_args(argv)
    budgets = tuple(int(x) for x in args.budgets.split(",") if x.strip())
    if any(b < 1 for b in budgets):
        p.error("--budgets: every budget must be >= 1")
    sizes = Sizes()
    if args.smoke:
        sizes = SMOKE
        args.device = "cpu" if args.device == "auto" else args.device
        args.max_model_len = min(args.max_model_len or 256, 256)
        if args.max_num_batched_tokens is None:
            args.max_num_batched_tokens = 64
        if args.num_kv_blocks is None:
            args.num_kv_blocks = 160
    args.no_progress = True
    if args.max_num_seqs is None:
        args.max_num_seqs = max(sizes.clients, sizes.tput_requests)
    from engine import LLMEngine

    executor, kind = build_executor(args)
    print(f"prefill_bench: starting {kind} executor for {args.model} ...", file=sys.stderr, flush=True)
    start_executor(executor, args)
    base = engine_config(args)
    vocab = executor.model_config.vocab_size

    def make(chunked: bool = True, caching: bool = True, budget: Optional[int] = None) -> Driver:
        tokens = (budget or base.max_num_batched_tokens) if chunked else None
        cfg = dataclasses.replace(base, enable_chunked_prefill=chunked, enable_prefix_caching=caching,
                                  max_num_batched_tokens=tokens)
        return Driver(LLMEngine(executor, cfg), vocab, seed=int(time.time_ns() % 2**31))

    warm = make()
    for n in (sizes.short, sizes.long):
        warm.run_one(warm.prompt(n), 4)
    results: dict[str, Any] = {"model": args.model, "executor": kind, "device": args.device, "sizes":
                               dataclasses.asdict(sizes), "budget": make().engine.sched_config.max_num_batched_tokens,
                               "block_size": executor.block_size, "num_kv_blocks": executor.num_kv_blocks}
    runs = {"ttft": scenario_ttft, "prefix": scenario_prefix_hit, "throughput": scenario_throughput,
            "clients": scenario_clients, "decode": scenario_decode_only}
    try:
        for name in args.scenarios.split(","):
            t0 = time.monotonic()
            results[name] = runs[name](make, sizes, budgets) if name == "clients" else runs[name](make, sizes)
            print(f"prefill_bench: {name} done in {time.monotonic() - t0:.1f} s", file=sys.stderr, flush=True)
    finally:
        if hasattr(executor, "shutdown"):
            executor.shutdown()
    print_table(results)
    write_json(args.out, results)
    return results


def print_table(r: dict) -> None:
    s = r["sizes"]
    print(f"\nprefill_bench  {r['model']} ({r['executor']}, {r['device']})  budget {r['budget']} tokens/step, "
          f"block {r['block_size']}, {r['num_kv_blocks']} KV blocks")
    rows: list[tuple[str, str, str]] = []
    if "ttft" in r:
        t = r["ttft"]
        for n in (s["short"], s["long"]):
            rows.append((f"TTFT, {n}-token prompt alone", f"{t[f'chunked_{n}_ms']} ms", f"{t[f'unchunked_{n}_ms']} ms"))
    if "prefix" in r:
        x = r["prefix"]
        rows.append((f"TTFT, {s['prefix']} cached + {s['suffix']} new (hit vs cache off)", f"{x['hit_ms']} ms",
                     f"{x['no_cache_ms']} ms"))
    if "throughput" in r:
        x = r["throughput"]
        rows.append((f"throughput {s['tput_requests']} x ({s['tput_prompt']} + {s['output']}), cache on no hits vs "
                     "off", f"{x['cache_on_no_hits_output_tok_s']} out tok/s",
                     f"{x['cache_off_output_tok_s']} out tok/s ({x['on_over_off']}x)"))
    if "clients" in r:
        c, u = r["clients"]["chunked"], r["clients"]["unchunked"]
        for key, label in (("ttft_p50_ms", "TTFT p50"), ("ttft_p99_ms", "TTFT p99"), ("tpot_p99_ms", "TPOT p99"),
                           ("gap_p99_ms", "token gap p99"), ("gap_max_ms", "token gap max")):
            rows.append((f"{s['clients']} clients ({s['client_prompt']} + {s['output']}), {label}", f"{c[key]} ms",
                         f"{u[key]} ms"))
        for name, x in r["clients"].items():
            if name.startswith("chunked_"):
                rows.append((f"  chunked at a {name[8:]}-token budget: TTFT p50 / p99, TPOT p50 / p99",
                             f"{x['ttft_p50_ms']} / {x['ttft_p99_ms']}", f"{x['tpot_p50_ms']} / {x['tpot_p99_ms']} ms"))
    if "decode" in r:
        d = r["decode"]
        rows.append((f"decode only, batch {d['batch']} at {d['context']} context, TPOT mean / p99",
                     f"{d['tpot_mean_ms']} / {d['tpot_p99_ms']} ms", "-"))
    w = max(len(a) for a, _, _ in rows)
    print(f"{'':<{w}}  {'chunked / cache on':>22}  {'unchunked / cache off':>22}")
    for a, b, c in rows:
        print(f"{a:<{w}}  {b:>22}  {c:>22}")


if __name__ == "__main__":
    main()
