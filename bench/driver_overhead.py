"""Host time of the pipe step path's hot pieces for one decode step (CPU only, no Ray, no model).

    python -m bench.driver_overhead                      # batches 1 and 64, context 128
    python -m bench.driver_overhead --batches 1,8,64 --iters 50000 --out /tmp/driver_overhead.json
    python -m bench.driver_overhead --sampling greedy,greedy_lp5 --no-coordinator   # + top-5 logprobs steps
    python -m bench.driver_overhead --batches 1,8,64 --sampling greedy,greedy_lp5 --tokenizer DIR  # + the server's

Every piece is timed call by call with `time.perf_counter_ns`, in `--rounds` rounds; reported is the smallest
round median (us), which a busy host disturbs less than one long median:
the driver's batch checks (`StepBatch.check_runnable`, `check_multi_step(1)`), the plan
(`plan_step`, one DP rank, without and with collectives across DP groups), the request frame
(`encode_request`), the rank's `decode_request` of that frame, the rank's reply (`encode_tokens`)
and the driver's `decode_reply`; "sum" adds the pieces of a strict step on one DP rank.

`--sampling` (`bench.dist_bench.SAMPLING_MODES`, side by side): a mode other than greedy carries its sampler
extras in the request (a logprobs mode: those the engine builds, `bench.engine_pieces.engine_extras`), and the
rank's host work of a sampled decode step is timed too: "stage_graph_rows" (the captured sampler head's rows:
`HostBatch` from the batch's arrays, staged and copied into a CPU parameter block) and, with logprobs, "read_back"
(`PendingTokens.result` of the packed tokens and logprobs, one host buffer); both count in "sum". The reply of a
logprobs mode is its `SampledTokens`.

"engine_step" (`LLMEngine.step` over an executor that answers at once; "engine_step mean": the mean of as many
further steps in one run, garbage collections included) and, for logprob modes, the server's conversion of a
step's logprobs to the OpenAI shapes ("openai_completion_lp", "openai_chat_lp"; `--tokenizer`: a local
checkpoint's tokenizer) are the engine's and the server's share (`bench.engine_pieces`), not in "sum".

"submit"/"collect" run `Coordinator.submit` and `Coordinator.collect` for real over a `PipeStepper`
whose rank ends are held here (real FIFOs, no rank processes): the request is drained and the reply
written between the two, untimed. They cover what the pieces above miss (argument checks, ticket
and in-flight bookkeeping, the pipe writes and reads, `select`, the step-shape key).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

import numpy as np

from actors.batch import StepBatch
from actors.pipes import read_frame, write_all
from actors.protocol import plan_step
from actors.wire import LENGTH, decode_reply, decode_request, encode_request, encode_tokens
from bench.dist_bench import decode_batch

PIECES = ("check_runnable", "check_multi_step", "plan_step local", "plan_step cross_dp", "encode_request",
          "decode_request", "encode_tokens", "decode_reply")
SUM_OF = ("check_runnable", "check_multi_step", "plan_step local", "encode_request", "decode_request",
          "encode_tokens", "decode_reply")
DECODE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
TOKEN_BUCKETS = (512, 1024, 2048, 4096)


def median_ns(fn: Callable[[], Any], iters: int, rounds: int, warmup: int = 200) -> float:
    """Wall time of one `fn()` call in nanoseconds: the smallest of `rounds` medians of `iters // rounds` calls."""
    for _ in range(warmup):
        fn()
    clock = time.perf_counter_ns
    n = max(1, iters // rounds)
    medians = []
    for _ in range(rounds):
        times = [0] * n
        for i in range(n):
            t0 = clock()
            fn()
            times[i] = clock() - t0
        medians.append(statistics.median(times))
    return min(medians)


def _rank_sampling_pieces(batch: StepBatch, vocab: int, max_blocks: int, block_size: int
                          ) -> tuple[dict[str, Callable[[], Any]], Any]:
    """The rank's host pieces of a sampled decode step of `batch` and the step's tokens (`SampledTokens` when it
    asks for logprobs, else int64 `[B]`)."""
    import torch

    from actors.decode_state import PendingTokens
    from actors.step_sampler import GRAPH_LOGPROBS, StepSampler, pack_logprobs

    b = batch.batch_size
    bucket = next(x for x in DECODE_BUCKETS if x >= b)
    sampler = StepSampler(torch.device("cpu"), vocab, max_blocks * block_size)
    for _ in sampler.graph_heads(lambda hidden, rows: hidden, DECODE_BUCKETS[-1]):
        pass  # allocates the heads' parameter block
    fns: dict[str, Callable[[], Any]] = {
        "stage_graph_rows": lambda: sampler.stage_graph_rows(batch, bucket, lambda rows, name: name)}
    tokens: Any = np.arange(b, dtype=np.int64)
    if batch.extras is not None and batch.extras.num_logprobs >= 0:
        g = torch.Generator().manual_seed(b)
        m, n = GRAPH_LOGPROBS, batch.extras.num_logprobs
        packed = pack_logprobs(torch.arange(bucket), -torch.rand(bucket, generator=g),
                               torch.randint(0, vocab, (bucket, m), generator=g),
                               -torch.rand(bucket, m, generator=g))[:b]
        host = torch.empty(packed.shape, dtype=torch.int32)
        host.copy_(packed)
        fns["read_back"] = lambda: PendingTokens(host, None, logprobs=n).result()
        tokens = fns["read_back"]()
    return fns, tokens


def time_pieces(batch: StepBatch, vocab: int, block_size: int, max_blocks: int, num_kv_blocks: int,
                iters: int, rounds: int) -> tuple[dict[str, float], Any]:
    """Median microseconds of each driver / rank hot-path piece for `batch`, and the step's reply tokens."""
    plan = plan_step([batch], cross_dp=False, decode_buckets=DECODE_BUCKETS, token_buckets=TOKEN_BUCKETS)
    body = encode_request(plan, 0)[LENGTH.size:]
    sampled = bool(batch.temperature.any()) or batch.extras is not None
    rank_fns, tokens = _rank_sampling_pieces(batch, vocab, max_blocks, block_size) if sampled else \
        ({}, np.arange(batch.batch_size, dtype=np.int64))
    reply = encode_tokens(tokens, 0.001)[LENGTH.size:]
    fns: dict[str, Callable[[], Any]] = {
        "check_runnable": lambda: batch.check_runnable(vocab, block_size, max_blocks, num_kv_blocks),
        "check_multi_step": lambda: batch.check_multi_step(1, block_size),
        "plan_step local": lambda: plan_step([batch], cross_dp=False, decode_buckets=DECODE_BUCKETS,
                                             token_buckets=TOKEN_BUCKETS),
        "plan_step cross_dp": lambda: plan_step([batch], cross_dp=True, decode_buckets=DECODE_BUCKETS,
                                                token_buckets=TOKEN_BUCKETS),
        "encode_request": lambda: encode_request(plan, 0),
        "decode_request": lambda: decode_request(body),
        "encode_tokens": lambda: encode_tokens(tokens, 0.001),
        "decode_reply": lambda: decode_reply(reply),
        **rank_fns,
    }
    out = {name: median_ns(fns[name], iters, rounds) / 1e3 for name in (*PIECES, *rank_fns)}
    out["sum"] = sum(out[name] for name in (*SUM_OF, *rank_fns))
    return out, tokens


class _LoopbackRanks:
    """The `RankSet` surface `PipeStepper` needs, with every rank's pipe ends held in this process: `start_pipe_loop`
    opens each request FIFO for reading (non-blocking, so no writer is needed yet) and each reply FIFO for writing."""

    def __init__(self, n: int):
        self.n = n
        self.requests: list[int] = []
        self.replies: list[int] = []

    def __len__(self) -> int:
        return self.n

    def call(self, method: str, paths: Any = (), **_: Any) -> list[None]:
        assert method == "start_pipe_loop"
        for req, resp, *_options in paths:
            self.replies.append(os.open(resp, os.O_WRONLY))
            fd = os.open(req, os.O_RDONLY | os.O_NONBLOCK)
            os.set_blocking(fd, True)
            self.requests.append(fd)
        return [None] * self.n

    def close(self) -> None:
        for fd in self.requests + self.replies:
            os.close(fd)


def time_coordinator(batch: StepBatch, vocab: int, block_size: int, max_blocks: int, num_kv_blocks: int,
                     iters: int, rounds: int, tokens: Any = None) -> dict[str, float]:
    """Microseconds of `Coordinator.submit` and `Coordinator.collect` (one DP rank, one TP rank) over real FIFOs
    (smallest round median, as `median_ns`); between the two the rank's request is read and its reply (`tokens`:
    int64 `[B]` or `SampledTokens`; None: arange) written (untimed)."""
    from actors.coordinator import Coordinator, DeploymentConfig
    from actors.pipes import PipeStepper
    from actors.rank import RuntimeConfig

    runtime = RuntimeConfig(block_size=block_size, max_model_len=max_blocks * block_size, num_kv_blocks=num_kv_blocks)
    coord = Coordinator(DeploymentConfig(runtime=runtime))
    ranks = _LoopbackRanks(1)
    stepper = PipeStepper(ranks, [0], timeout_s=5.0, poll_s=0.0)
    # a serving coordinator without Ray: the state start() would leave behind
    coord._state, coord._stepper = "serving", stepper
    coord._model_config = SimpleNamespace(vocab_size=vocab)
    coord._num_kv_blocks, coord._sizes = num_kv_blocks, (list(DECODE_BUCKETS), list(TOKEN_BUCKETS))
    reply = encode_tokens(np.arange(batch.batch_size, dtype=np.int64) if tokens is None else tokens, 0.001)
    clock = time.perf_counter_ns
    n = max(1, iters // rounds)
    submit, collect = [], []
    try:
        for r in range(rounds + 1):  # round 0: warm-up
            sub, col = [0] * n, [0] * n
            for i in range(n):
                t0 = clock()
                ticket = coord.submit([batch])
                t1 = clock()
                read_frame(ranks.requests[0])
                write_all(ranks.replies[0], reply)
                t2 = clock()
                coord.collect(ticket)
                sub[i], col[i] = t1 - t0, clock() - t2
            if r:
                submit.append(statistics.median(sub))
                collect.append(statistics.median(col))
    finally:
        stepper.teardown()
        ranks.close()
    return {"submit": min(submit) / 1e3, "collect": min(collect) / 1e3}


def print_table(results: dict[Any, dict[str, float]]) -> None:
    """One column per point (a batch size, or "B mode" for a sampling mode other than greedy); "-": not timed."""
    sizes = list(results)
    names = list(dict.fromkeys(n for r in results.values() for n in r))
    width = max(10, *(len(str(b)) + 4 for b in sizes))
    print(f"{'piece (median us)':<22}" + "".join(f"{'B=' + str(b):>{width}}" for b in sizes))
    for name in names:
        print(f"{name:<22}" + "".join(f"{results[b][name]:>{width}.2f}" if name in results[b] else f"{'-':>{width}}"
                                      for b in sizes))


def main(argv: list[str] | None = None) -> dict[int, dict[str, float]]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", default="1,64", help="decode batch sizes (comma list)")
    p.add_argument("--context", type=int, default=128, help="cached tokens per sequence")
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--max-blocks-per-seq", type=int, default=64)
    p.add_argument("--num-kv-blocks", type=int, default=4096)
    p.add_argument("--iters", type=int, default=20000, help="timed calls per piece")
    p.add_argument("--rounds", type=int, default=40, help="report the smallest median of this many rounds")
    p.add_argument("--no-coordinator", action="store_true", help="skip the submit/collect rows (FIFOs)")
    p.add_argument("--sampling", default="greedy",
                   help="comma list of sampling modes (bench.dist_bench.SAMPLING_MODES), one column each per batch")
    p.add_argument("--engine-iters", type=int, default=4000, help="timed engine steps per point (0: none)")
    p.add_argument("--tokenizer", default=None, help="a local checkpoint directory: its tokenizer for the openai rows")
    p.add_argument("--out", default=None, help="also write the table as JSON here")
    args = p.parse_args(argv)
    from bench.dist_bench import with_sampling
    from bench.engine_pieces import engine_extras, engine_step_fn, load_tokenizer, mean_us, openai_fns

    tokenizer = load_tokenizer(args.tokenizer)

    results: dict[Any, dict[str, float]] = {}
    for b in (int(x) for x in args.batches.split(",")):
        for mode in args.sampling.split(","):
            batch = decode_batch(b, args.context, args.block_size, args.num_kv_blocks, args.vocab)
            if mode != "greedy":
                batch = with_sampling(batch, mode)
            if batch.extras is not None:  # the extras the engine builds for rows asking only for logprobs
                batch.extras = engine_extras(b, batch.extras.num_logprobs)
            key: Any = b if mode == "greedy" else f"{b} {mode}"
            dims = (args.vocab, args.block_size, args.max_blocks_per_seq, args.num_kv_blocks, args.iters, args.rounds)
            results[key], tokens = time_pieces(batch, *dims)
            if not args.no_coordinator:
                results[key].update(time_coordinator(batch, *dims, tokens=tokens))
            if args.engine_iters:
                step = engine_step_fn(b, mode, args.context, args.vocab, 2 * args.engine_iters + 200)
                results[key]["engine_step"] = median_ns(step, args.engine_iters, args.rounds) / 1e3
                results[key]["engine_step mean"] = mean_us(step, args.engine_iters)
            for name, fn in openai_fns(b, mode, args.vocab, tokenizer).items():
                results[key][name] = median_ns(fn, max(200, args.iters // 20), args.rounds, warmup=20) / 1e3
    print_table(results)
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "us": results}, indent=2))
    return results


if __name__ == "__main__":
    main()
