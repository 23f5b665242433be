"""`RankWorker`: the thin `@ray.remote` shell around one rank's `RankRuntime`.

One actor per rank, placed on its own placement-group bundle. Concurrency:
- default group (one thread): set-up, capture, reset, plain-path steps: the rank's
  device work is serialised here;
- "health" group: `health()` / `info()` answer while a step or a capture runs (the
  coordinator's sentinel for hung ranks);
- the pipe step path (`start_pipe_loop`, the default when every rank shares the driver's
  host) runs steps on a resident thread of its own; Ray's "_ray_system" group runs the
  compiled-graph step loop (`execute_step`) when the coordinator uses compiled graphs. The
  coordinator never overlaps steps with set-up calls.
Every method first binds the rank's CUDA device (current device is per thread).

The worker forwards; its parts own their state:
- `actors.rank_phase.RankPhase`: the phase the heartbeat reports, the per-thread device binding;
- `actors.event_log.EventLog`: start-up captures and reset phases with timestamps, which the
  coordinator and tests use to check the lock-step and reset ordering protocols;
- `actors.rank_steps.RankSteps`: launch / finish a step (every step path), step count and times;
- `actors.pipe_loop.PipeLoop`: the pipe step path's resident loop and its decode arming;
- `actors.step_tracing.StepTracer`: the loop's step trace (read back by `step_trace`), its profiler;
- `actors.fault_injection`: what the `_test_*` hooks set (injected faults, a logits recorder),
  for the CPU tests only.
"""
from __future__ import annotations

import contextlib
import os
import time
from typing import Any

import ray

from actors.event_log import EventLog
from actors.fault_injection import FaultInjector, LogitsRecorder
from actors.pipe_loop import PipeLoop
from actors.placement import ActorPlace
from actors.protocol import StepPlan
from actors.rank_phase import RankPhase
from actors.rank_steps import RankSteps
from actors.step_tracing import StepTracer


@ray.remote(concurrency_groups={"health": 2, "heartbeat": 1})
class RankWorker:
    def __init__(self, bundle: int, test_faults: dict | None = None):
        constructing = time.time()
        import torch
        self._started = {"constructing": constructing, "torch": time.time()}

        self.bundle = bundle
        self.rank: int | None = None
        self.coords: Any = None
        self.runtime: Any = None
        self.groups: Any = None
        self.device: Any = None
        self._store: Any = None
        self._cfg: Any = None
        self._kernel_warm_up: Any = None  # actors.kernel_warm_up.KernelWarmUp: start_kernel_warm_up to build_runner
        self._ep_backend = "allgather"
        self._events = EventLog()
        self._phase = RankPhase()
        self._captures = 0
        self._faults = FaultInjector(test_faults)
        self._steps = RankSteps(self._phase, self._faults)
        self._tracer = StepTracer()
        self._pipe_loop: PipeLoop | None = None  # from the first start_pipe_loop
        self._logits = LogitsRecorder()
        self._gpu = bool(ray.get_gpu_ids())
        if not self._gpu:
            torch.set_num_threads(1)
        self._started["constructed"] = time.time()

    # ------------------------------------------------------------------ helpers
    @staticmethod
    def _local_gpu_index() -> int:
        """This actor's GPU as a CUDA index: 0 under Ray's default isolation (only that GPU is visible);
        with every GPU visible (TP ranks, see `actors.startup`), its position among the visible devices."""
        from actors.environment import visible_gpu_ids

        ids = [str(g) for g in ray.get_gpu_ids()]
        visible = visible_gpu_ids()
        if not ids or visible is None:
            return 0
        return visible.index(ids[0]) if ids[0] in visible else int(ids[0])

    # ------------------------------------------------------------------ placement + groups
    def place(self) -> ActorPlace:
        ctx = ray.get_runtime_context()
        return ActorPlace(bundle=self.bundle, node_id=ctx.get_node_id(), node_ip=ray.util.get_node_ip_address(),
                          gpu_ids=tuple(str(g) for g in ray.get_gpu_ids()), pid=os.getpid(), started=self._started)

    def serve_rendezvous(self, world: int, timeout_s: float):
        """Rank 0 only: start the TCPStore on port 0 and report (host, port)."""
        from parallel.groups import serve_rendezvous

        self._store, rv = serve_rendezvous(world, timeout_s, host=ray.util.get_node_ip_address())
        return rv

    def start_kernel_warm_up(self, cfg: Any, tp_size: int, device: str, tp_rank: int = 0, comm: Any = None) -> bool:
        """Start compiling the attention kernels of `cfg`'s model in the background (`actors.kernel_warm_up`),
        before the process groups form; returns at once. False (nothing started) without a GPU."""
        from actors.kernel_warm_up import KernelWarmUp
        from actors.rank import resolve_device

        if not self._gpu:
            return False
        dev = resolve_device(device, self._local_gpu_index())
        if dev.type != "cuda":
            return False
        self._kernel_warm_up = KernelWarmUp(cfg, tp_size, dev, tp_rank, comm)
        return True

    def init_groups(self, rank: int, topo: Any, rendezvous: Any, use_gpu: bool, device: str,
                    timeout_s: float, cfg: Any = None, comm: Any = None) -> dict[str, float]:
        """Join the world and create this rank's groups; returns seconds per phase (`RankGroups.timings`) and
        "total_s". `cfg` (`RuntimeConfig`, optional): the model served, whose hidden size and dtype the fused
        TP all-reduce is probed for; `comm`: the deployment's `CommOptions`. Every rank cross-checks both option
        objects before any collective (`RankGroups.init`)."""
        import torch

        from actors.rank import resolve_device
        from parallel.groups import RankGroups

        t0 = time.perf_counter()
        self.rank, self.coords = rank, topo.coords(rank)
        self.device = resolve_device(device, self._local_gpu_index()) if use_gpu else torch.device("cpu")
        self._phase.device = self.device
        self._phase.enter("init_groups")
        probe = None
        if cfg is not None and self.device.type == "cuda" and topo.tp > 1:
            mc = cfg.model_config(self.device)
            probe = (mc.hidden_size, mc.dtype)
        early = self._kernel_warm_up
        kernels = {"kernels": self._faults.kernels(cfg.kernels)} if cfg is not None else {}
        self.groups = RankGroups(topo, rank, self.device, timeout_s, comm, fused_probe=probe,
                                 before_tp_setup=None if early is None else early.wait_fused, check_options=kernels)
        self.groups.init(rendezvous, store=self._store)
        self._phase.leave()
        return {**self.groups.timings, "total_s": time.perf_counter() - t0}

    def build_runtime(self, cfg: Any, ep_backend: str) -> dict[str, Any]:
        """Build the context (EP dispatcher included) and the Ray-free runtime; returns model facts."""
        from actors.rank import RankRuntime

        self._phase.enter("build_runtime")
        self._cfg, self._ep_backend = cfg, ep_backend
        model_cfg = cfg.model_config(self.device)
        g = cfg.graph
        max_decode = max(g.decode_buckets(), default=0)
        ctx = self.groups.build_context(ep_backend, model_cfg, max_decode_tokens=max_decode)
        self.runtime = RankRuntime(cfg, ctx, self.device)
        self._steps.attach(self.runtime, self.rank, self.coords.tp_rank)
        self._phase.leave()
        return {"model_config": self.runtime.model_config, "device": str(self.device)}

    # ------------------------------------------------------------------ start-up
    def load_model(self) -> float:
        with self._phase.during("load_model"):
            return self.runtime.load_model()

    def kv_blocks_for_budget(self) -> int:
        with self._phase.during("kv_budget"):
            return int(self.runtime.kv_blocks_for_budget())

    def allocate_kv_cache(self, num_blocks: int) -> int:
        with self._phase.during("allocate_kv"):
            return int(self.runtime.allocate_kv_cache(num_blocks))

    def build_runner(self) -> None:
        with self._phase.during("build_runner"):
            self._new_runner()
            self.prepare_dispatcher()  # e.g. the DeepEP buffer: allocated before any capture

    def _new_runner(self) -> None:
        """The runtime's runner (once the early kernel warm-up finished), with the reset hook."""
        early, self._kernel_warm_up = self._kernel_warm_up, None
        if early is not None:
            self.runtime.timings["early_kernel_warm_up_s"] = early.join()
        self.runtime.build_runner()
        self.runtime.runner.add_reset_hook(self._on_runner_reset)

    def capture_sizes(self) -> tuple[list[int], list[int]]:
        return self.runtime.capture_sizes()

    def capture(self, kind: str, bucket: int) -> float:
        """Capture one bucket (the coordinator calls every rank for the same bucket, in lock-step)."""
        what = f"{kind}:{bucket}"
        with self._phase.during(f"capture {what}"):
            self._captures += 1
            self._events.log("capture_start", bucket=what)
            try:
                self._faults.in_capture(self._captures, what)
                rt, decode = self.runtime, kind == "decode"
                disp = rt.ctx.ep_dispatcher
                static = disp.static_tokens(bucket) if disp is not None and decode else contextlib.nullcontext()
                with static:
                    s = rt.capture_decode(bucket) if decode else rt.capture_prefill(bucket)
                self._events.log("capture_end", bucket=what, seconds=s)
                return s
            except BaseException as e:
                self._events.log("capture_failed", bucket=what, error=repr(e))
                raise

    # ------------------------------------------------------------------ steps
    def execute_step(self, plan: StepPlan) -> tuple[Any, float]:
        """Run this rank's part of `plan` (its DP rank's batch under the plan's `StepHints`, the plain and compiled
        step paths); returns (next tokens on TP rank 0 else None, in-rank seconds)."""
        args = plan.rank_args(self.coords.dp_rank)
        if args is None:
            return None, 0.0
        return self._steps.run(args, plan.static_tokens, plan.num_steps)

    def start_pipe_loop(self, request_path: str, reply_path: str, trace: bool = False,
                        profile: str | None = None) -> None:
        """Start the resident step loop of the pipe step path (`actors.pipe_loop`): a thread that reads packed
        requests from `request_path` and writes replies to `reply_path` until the driver closes its end.
        The coordinator never overlaps steps with set-up calls, so the loop and this actor's default
        thread do not run device work at the same time. `trace` / `profile`: `DriverOptions.step_trace` /
        `step_profile`."""
        self._tracer.configure(trace, profile)
        if self._pipe_loop is None:
            self._pipe_loop = PipeLoop(self._steps, self.runtime, self._tracer, self._events.log)
        self._pipe_loop.start(request_path, reply_path)

    def step_trace(self, clear: bool = False) -> list[dict[str, float]]:
        """The pipe loop's trace records (`DriverOptions.step_trace`), oldest first; perf_counter seconds."""
        return self._tracer.read(clear)

    def step_times(self, clear: bool = False) -> list[float]:
        return self._steps.times(clear)

    # ------------------------------------------------------------------ reset
    def _on_runner_reset(self) -> None:
        self._events.runner_reset(self.runtime.runner)  # graphs dropped, then the DeepEP buffer

    def reset(self) -> list[dict[str, Any]]:
        """graphs (runner.reset) -> DeepEP buffer (its reset hook) -> barrier; returns this reset's events."""
        with self._phase.during("reset"):
            n0 = len(self._events)
            self.runtime.reset()
            if not self._events.reset_ran_hook(n0):  # no runner yet
                self._events.reset_without_runner()
            self.groups.barrier()
            self._events.log("reset_barrier")
            self._captures = 0
            return self._events.since(n0)

    def abort_capture(self) -> dict[str, Any]:
        """Start-up capture failed somewhere: drop whatever this rank captured (no barrier: the
        group may be out of step). Returns the runner stats afterwards."""
        with self._phase.during("abort_capture"):
            if self.runtime is not None and self.runtime.runner is not None:
                self.runtime.reset()
            self._events.log("capture_aborted")
            self._captures = 0
            return self.runtime.runner.stats.snapshot() if self.runtime.runner is not None else {}

    def reload_weights(self) -> float:
        """After a reset: load the weights again and rebuild the runner around the new model."""
        with self._phase.during("reload_weights"):
            s = self.runtime.load_model()
            self._new_runner()
            return s

    def prepare_dispatcher(self) -> None:
        disp = self.runtime.ctx.ep_dispatcher
        if disp is not None:
            disp.prepare()

    def shutdown(self) -> None:
        self._phase.enter("shutdown")
        if self.groups is not None:
            self.groups.destroy()
        self._store = None

    # ------------------------------------------------------------------ health (answers during steps)
    @ray.method(concurrency_group="heartbeat")
    def heartbeat(self) -> dict[str, Any]:
        """The driver's watcher asks this every fraction of a second (`actors.watch`): answered on a thread of
        its own, whatever the rank is doing; no answer means the process is stopped or gone."""
        return {"phase": self._phase.name, "phase_s": self._phase.seconds(), "steps": self._steps.count}

    @ray.method(concurrency_group="health")
    def health(self) -> dict[str, Any]:
        return {"rank": self.rank, "phase": self._phase.name, "phase_s": self._phase.seconds(),
                "pid": os.getpid(), "steps": self._steps.count}

    @ray.method(concurrency_group="health")
    def info(self) -> dict[str, Any]:
        out: dict[str, Any] = {"rank": self.rank, "bundle": self.bundle, "pid": os.getpid(), "phase": self._phase.name,
                               "steps": self._steps.count, "device": str(self.device) if self.device else None}
        if self.coords is not None:
            c = self.coords
            out.update(dp_rank=c.dp_rank, tp_rank=c.tp_rank, ep_rank=c.ep_rank)
        if self.groups is not None:
            out["tp_allreduce"] = self.groups.tp_allreduce_info()
        if self.runtime is not None:
            for _ in range(3):  # the step thread may mutate counters meanwhile
                try:
                    out["runtime"] = self.runtime.stats()
                    break
                except RuntimeError:
                    time.sleep(0.01)
        times = self._steps.times()
        out["in_rank_step_ms_mean"] = 1e3 * sum(times) / len(times) if times else None
        return out

    @ray.method(concurrency_group="health")
    def event_log(self) -> list[dict[str, Any]]:
        return self._events.all()

    @ray.method(concurrency_group="health")
    def _test_set_faults(self, **faults: Any) -> None:
        """Tests only: add or change injected faults (`actors.fault_injection`)."""
        self._faults.update(**faults)

    def _test_record_logits(self) -> None:
        """Tests only: keep the fp32 logits of every execute (the runtime's logits observer)."""
        self._logits.start(self.runtime)

    def _test_stop_recording_logits(self) -> None:
        """Tests only: drop the logits observer (greedy steps take the greedy LM head again)."""
        self._logits.stop(self.runtime)

    def _test_last_logits(self) -> Any:
        return self._logits.last
