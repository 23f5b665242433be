"""Where the symmetric-memory set-up of a TP group spends its time: two spawned ranks (one GPU each) time the
process's first `symm_mem.empty`, the first `rendezvous`, and a second allocation + rendezvous; then again with a
small allocation made before the process group exists (what an early background thread could take off the
group set-up).

    python -m bench.symm_setup_bench            # needs two CUDA GPUs

Prints one line per rank and variant, seconds.
"""
from __future__ import annotations

import os
import socket
import time

import torch


def _rank(rank: int, port: int, early: bool) -> None:
    import torch.distributed as dist
    import torch.distributed._symmetric_memory as symm_mem

    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    dev = torch.device("cuda", rank)
    torch.cuda.set_device(dev)
    torch.zeros(1, device=dev)
    torch.cuda.synchronize(dev)
    t: dict[str, float] = {}
    keep = []
    if early:
        a = time.perf_counter()
        keep.append(symm_mem.empty(16, dtype=torch.uint8, device=dev))
        t["early_empty"] = time.perf_counter() - a
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0)
    dist.init_process_group("nccl", store=store, rank=rank, world_size=2, device_id=dev)
    name = dist.group.WORLD.group_name
    a = time.perf_counter()
    buf = symm_mem.empty(1 << 20, dtype=torch.uint8, device=dev)
    t["first_empty"] = time.perf_counter() - a
    a = time.perf_counter()
    keep.append(symm_mem.rendezvous(buf, name))
    t["first_rendezvous"] = time.perf_counter() - a
    a = time.perf_counter()
    buf2 = symm_mem.empty(1 << 20, dtype=torch.uint8, device=dev)
    keep.append(symm_mem.rendezvous(buf2, name))
    t["second_both"] = time.perf_counter() - a
    print(f"early={early} rank {rank} backend {symm_mem.get_backend(dev)}: "
          + "  ".join(f"{k} {v:.3f}" for k, v in t.items()), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    import torch.multiprocessing as mp

    if torch.cuda.device_count() < 2:
        raise SystemExit("needs two CUDA GPUs")
    for early in (False, True):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.spawn(_rank, args=(port, early), nprocs=2, join=True)


if __name__ == "__main__":
    main()
