"""Where the symmetric-memory set-up of a TP group spends its time: two spawned ranks (one GPU each, a fresh pair of
processes per variant) time the process's first symmetric allocation, the first `rendezvous`, and a second
allocation + rendezvous:

- `wrapper`: `torch.distributed._symmetric_memory.empty`, which computes the contiguous stride through
  `torch._prims_common`; its first use in a process imports sympy (the modules imported are counted);
- `direct`: `parallel.symm_allreduce.symm_empty_bytes`, the same allocation without that wrapper (what the TP
  all-reduce and the fused kernel's buffers use).
A ticker thread counts how often it got the GIL during the first allocation (about one tick per millisecond when
the allocation releases it).

    python -m bench.symm_setup_bench            # needs two CUDA GPUs

Prints one line per rank and variant, seconds.
"""
from __future__ import annotations

import os
import socket
import sys
import threading
import time

import torch

VARIANTS = ("wrapper", "direct")


class _Ticker:
    """Counts 1 ms sleeps on a thread: how often it held the GIL while the main thread was in a C++ call."""

    def __init__(self):
        self.ticks = 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.ticks += 1
            time.sleep(0.001)

    def stop(self) -> int:
        self._stop.set()
        self._t.join()
        return self.ticks


def _rank(rank: int, port: int, variant: str) -> None:
    import torch.distributed as dist
    import torch.distributed._symmetric_memory as symm_mem

    from parallel.symm_allreduce import symm_empty_bytes

    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    dev = torch.device("cuda", rank)
    torch.cuda.set_device(dev)
    torch.zeros(1, device=dev)
    torch.cuda.synchronize(dev)

    def alloc(nbytes: int) -> torch.Tensor:
        if variant == "wrapper":
            return symm_mem.empty(nbytes, dtype=torch.uint8, device=dev)
        return symm_empty_bytes(nbytes, dev)

    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0)
    dist.init_process_group("nccl", store=store, rank=rank, world_size=2, device_id=dev)
    dist.barrier()
    name = dist.group.WORLD.group_name
    t: dict[str, float] = {}
    modules = set(sys.modules)
    ticker = _Ticker()
    a = time.perf_counter()
    buf = alloc(1 << 20)
    t["first_alloc"] = time.perf_counter() - a
    t["gil_ticks_per_ms"] = ticker.stop() / max(t["first_alloc"] * 1e3, 1e-9)
    t["modules_imported"] = len(set(sys.modules) - modules)
    keep = []
    a = time.perf_counter()
    keep.append(symm_mem.rendezvous(buf, name))
    t["first_rendezvous"] = time.perf_counter() - a
    a = time.perf_counter()
    buf2 = alloc(1 << 20)
    keep.append(symm_mem.rendezvous(buf2, name))
    t["second_both"] = time.perf_counter() - a
    print(f"{variant:8s} rank {rank}: " + "  ".join(f"{k} {v:.3f}" for k, v in t.items()), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    import argparse

    import torch.multiprocessing as mp

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", default=",".join(VARIANTS))
    args = p.parse_args()
    if torch.cuda.device_count() < 2:
        raise SystemExit("needs two CUDA GPUs")
    for variant in args.variants.split(","):
        if variant not in VARIANTS:
            raise SystemExit(f"unknown variant {variant!r}; choose from {', '.join(VARIANTS)}")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.spawn(_rank, args=(port, variant), nprocs=2, join=True)


if __name__ == "__main__":
    main()
