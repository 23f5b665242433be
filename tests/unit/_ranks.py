"""Run a function on several gloo ranks in forked processes, for the CPU tests of collective code.

`run_ranks(target, world)` forks `world` processes (fork: `target` may live in a `python -c` program or a test
module), each calling `target(rank, init_method, queue)` with a file rendezvous in a fresh temporary directory;
each rank puts one tuple `(rank, *payload)` on the queue. Returns {rank: payload tuple}.
"""
import os
import tempfile

import torch.multiprocessing as mp


def run_ranks(target, world: int = 2, timeout_s: float = 120) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        init = "file://" + os.path.join(tmp, "rdzv")
        ctx = mp.get_context("fork")
        q = ctx.Queue()
        procs = [ctx.Process(target=target, args=(r, init, q), daemon=True) for r in range(world)]
        for p in procs:
            p.start()
        got = dict((g[0], g[1:]) for g in (q.get(timeout=timeout_s) for _ in range(world)))
        for p in procs:
            p.join(30)
    return got
