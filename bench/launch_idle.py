"""How long the rank's decode launch takes on the host after the device and the launching thread were idle.

    python -m bench.launch_idle --out artifacts/launch_idle.json       # one GPU, qwen3-0.6b, batch 1

A `RankRuntime` (decode buckets up to 8) launches batch-1 greedy decode steps through its decode lane
(`RankRuntime.launch(..., validated=True)`), each after an idle gap of `--gaps` microseconds spent one of
five ways: spinning on `select` (what the pipe step loop does), sleeping, spinning while a tiny kernel is
queued on a side stream every 50 us ("keepalive"), spinning while one device sleep kernel covers the gap,
or spinning while the step waits armed (`actors.armed`: enqueued behind a gate right after the step
before, so the launch only opens it). Printed per way and gap, over `--rounds` interleaved rounds: the median and p90 host time of the
launch call and the median launch-to-tokens time. The step trace (`bench.step_trace`) shows the same
launch inside the worker's step loop; this isolates it from the pipes and Ray.
"""
from __future__ import annotations

import argparse
import os
import select
import statistics
import time

import torch

from actors.rank import RankRuntime, RuntimeConfig
from bench.common import machine, write_json
from bench.graph_bench import _decode_batch
from graphrunner.config import GraphRunnerConfig
from parallel.context import ParallelContext


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3-0.6b")
    p.add_argument("--gaps", default="100,300,1000", help="idle gaps before each launch, microseconds")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    dev = torch.device("cuda", 0)
    cfg = RuntimeConfig(model=args.model, device="cuda", num_kv_blocks=2048,
                        graph=GraphRunnerConfig(max_decode_batch=8, pcg_max_tokens=128))
    rt = RankRuntime(cfg, ParallelContext(), dev)
    rt.load_model()
    rt.allocate_kv_cache()
    rt.build_runner()
    rt.capture_all()
    torch.cuda.set_stream(rt.stream)
    rt.bind_stream()
    batch = _decode_batch(rt, 1, 128)
    r, _w = os.pipe()
    side, dummy = torch.cuda.Stream(), torch.zeros(1, device=dev)

    def spin(g: float) -> None:
        end = time.perf_counter() + g
        while time.perf_counter() < end:
            select.select([r], [], [], 0)

    def keepalive(g: float) -> None:
        end, nxt = time.perf_counter() + g, 0.0
        while (now := time.perf_counter()) < end:
            if now >= nxt:
                with torch.cuda.stream(side):
                    dummy.add_(1)
                nxt = now + 50e-6
            select.select([r], [], [], 0)

    def device_sleep(g: float) -> None:
        with torch.cuda.stream(side):
            torch.cuda._sleep(int(g * 1.98e9))  # cycles at about the boost clock
        spin(g)

    # "armed": spin, but each step is enqueued behind a gate right after the step before (`actors.armed`,
    # what the pipe step loop does after a strict step), so the launch after the gap only opens it
    ways = {"spin": spin, "sleep": time.sleep, "keepalive": keepalive, "device_sleep": device_sleep, "armed": spin}
    med = lambda xs: round(1e6 * statistics.median(xs), 1)  # noqa: E731
    rows = []
    with torch.inference_mode():
        for _ in range(20):
            rt.launch(batch, validated=True).result()
        for rnd in range(args.rounds):
            for name, idle in ways.items():
                for gap_us in (int(x) for x in args.gaps.split(",")):
                    launch, total = [], []
                    armed = name == "armed"
                    if armed:
                        rt.arm_next()
                    for _ in range(args.steps):
                        idle(gap_us * 1e-6)
                        t0 = time.perf_counter()
                        pending = rt.launch(batch, validated=True)
                        t1 = time.perf_counter()
                        if armed:
                            rt.arm_next()
                        pending.result()
                        launch.append(t1 - t0)
                        total.append(time.perf_counter() - t0)
                    row = {"round": rnd, "idle": name, "gap_us": gap_us, "launch_us": med(launch),
                           "launch_p90_us": round(1e6 * sorted(launch)[int(0.9 * len(launch))], 1),
                           "total_us": med(total)}
                    if armed:
                        rt.disarm()
                    rows.append(row)
                    print(f"round {rnd} idle {name:12s} {gap_us:5d} us: launch {row['launch_us']} (p90 "
                          f"{row['launch_p90_us']}), launch to tokens {row['total_us']}", flush=True)
    res = {"machine": machine(), "model": args.model, "lane_steps": rt.lane_steps,
           "armed_decode": rt.stats().get("armed_decode"), "rows": rows}
    write_json(args.out, res)
    return res


if __name__ == "__main__":
    main()
