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

The worker keeps an event log (start-up captures and reset phases with timestamps) that
the coordinator and tests use to check the lock-step and reset ordering protocols.
`_test_*` options inject faults for the CPU tests only.
"""
from __future__ import annotations

import contextlib
import os
import select
import threading
import time
from collections import deque
from typing import Any, Optional

import ray

from actors.errors import RankStepError
from actors.placement import ActorPlace

PIPE_SPIN_S = 0.003  # how long a GPU rank's step loop polls for the next request before blocking


class _TestFault(RuntimeError):
    """An injected failure (tests only)."""


class _Launched:
    """A step enqueued on the rank's device: its `PendingTokens` and when its launch began (perf_counter)."""

    __slots__ = ("pending", "t0", "trace")

    def __init__(self, pending: Any, t0: float):
        self.pending, self.t0, self.trace = pending, t0, None


@ray.remote(concurrency_groups={"health": 2, "heartbeat": 1})
class RankWorker:
    def __init__(self, bundle: int, test_faults: Optional[dict] = None):
        constructing = time.time()
        import torch
        self._started = {"constructing": constructing, "torch": time.time()}

        self.bundle = bundle
        self.rank: Optional[int] = None
        self.coords: Any = None
        self.runtime: Any = None
        self.groups: Any = None
        self.device: Any = None
        self._store: Any = None
        self._cfg: Any = None
        self._kernel_warm_up: Any = None  # actors.kernel_warm_up.KernelWarmUp, from start_kernel_warm_up to build_runner
        self._arm_failure: Optional[BaseException] = None  # a failed collective arm: every later step fails
        self._ep_backend = "allgather"
        self.events: list[dict[str, Any]] = []
        self.phase, self.phase_since = "created", time.time()
        self._steps = 0
        self._in_flight = 0  # steps launched and not yet finished (the pipe loop may run two at once)
        self._step_times: deque[float] = deque(maxlen=4096)
        self._trace: deque[dict[str, float]] = deque(maxlen=4096)  # step trace records, oldest first
        self._captures = 0
        self._faults = dict(test_faults or {})
        self._threads_set: set[int] = set()  # threads limited to one intra-op thread (CPU ranks)
        self._thread = threading.local()  # `.on_device`: this thread's current device is the rank's GPU
        self._gpu = bool(ray.get_gpu_ids())
        if not self._gpu:
            torch.set_num_threads(1)
        self._started["constructed"] = time.time()

    # ------------------------------------------------------------------ helpers
    def _enter(self, phase: str) -> None:
        import torch

        self.phase, self.phase_since = phase, time.time()
        if self.device is not None and self.device.type == "cuda":
            if not getattr(self._thread, "on_device", False):  # the current device is per thread; nothing resets it
                torch.cuda.set_device(self.device)
                self._thread.on_device = True
        elif threading.get_ident() not in self._threads_set:
            torch.set_num_threads(1)  # per thread: the compiled-graph loop runs on its own thread
            self._threads_set.add(threading.get_ident())

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

    def _leave(self) -> None:
        self.phase, self.phase_since = "idle", time.time()

    def _log(self, kind: str, **detail: Any) -> None:
        self.events.append({"t": time.time(), "kind": kind, **detail})

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
        self._enter("init_groups")
        probe = None
        if cfg is not None and self.device.type == "cuda" and topo.tp > 1:
            mc = cfg.model_config(self.device)
            probe = (mc.hidden_size, mc.dtype)
        early = self._kernel_warm_up
        kernels = {"kernels": self._faults.get("kernels_override", cfg.kernels)} if cfg is not None else {}
        self.groups = RankGroups(topo, rank, self.device, timeout_s, comm, fused_probe=probe,
                                 before_tp_setup=None if early is None else early.wait_fused, check_options=kernels)
        self.groups.init(rendezvous, store=self._store)
        self._leave()
        return {**self.groups.timings, "total_s": time.perf_counter() - t0}

    def build_runtime(self, cfg: Any, ep_backend: str) -> dict[str, Any]:
        """Build the context (EP dispatcher included) and the Ray-free runtime; returns model facts."""
        from actors.rank import RankRuntime

        self._enter("build_runtime")
        self._cfg, self._ep_backend = cfg, ep_backend
        model_cfg = cfg.model_config(self.device)
        g = cfg.graph
        max_decode = max(g.decode_buckets(), default=0)
        ctx = self.groups.build_context(ep_backend, model_cfg, max_decode_tokens=max_decode)
        self.runtime = RankRuntime(cfg, ctx, self.device)
        self._leave()
        return {"model_config": self.runtime.model_config, "device": str(self.device)}

    # ------------------------------------------------------------------ start-up
    def load_model(self) -> float:
        self._enter("load_model")
        try:
            return self.runtime.load_model()
        finally:
            self._leave()

    def kv_blocks_for_budget(self) -> int:
        self._enter("kv_budget")
        try:
            return int(self.runtime.kv_blocks_for_budget())
        finally:
            self._leave()

    def allocate_kv_cache(self, num_blocks: int) -> int:
        self._enter("allocate_kv")
        try:
            return int(self.runtime.allocate_kv_cache(num_blocks))
        finally:
            self._leave()

    def build_runner(self) -> None:
        self._enter("build_runner")
        try:
            early, self._kernel_warm_up = self._kernel_warm_up, None
            if early is not None:
                self.runtime.timings["early_kernel_warm_up_s"] = early.join()
            self.runtime.build_runner()
            self.runtime.runner.add_reset_hook(self._on_runner_reset)
            disp = self.runtime.ctx.ep_dispatcher
            if disp is not None:
                disp.prepare()  # e.g. the DeepEP buffer: allocated before any capture
        finally:
            self._leave()

    def capture_sizes(self) -> tuple[list[int], list[int]]:
        return self.runtime.capture_sizes()

    def capture(self, kind: str, bucket: int) -> float:
        """Capture one bucket (the coordinator calls every rank for the same bucket, in lock-step)."""
        self._enter(f"capture {kind}:{bucket}")
        self._captures += 1
        self._log("capture_start", bucket=f"{kind}:{bucket}")
        try:
            if self._faults.get("fail_capture_at") == self._captures:
                raise _TestFault(f"injected failure in capture #{self._captures} ({kind}:{bucket})")
            disp = self.runtime.ctx.ep_dispatcher
            static = disp.static_tokens(bucket) if (disp is not None and kind == "decode") else contextlib.nullcontext()
            with static:
                s = self.runtime.capture_decode(bucket) if kind == "decode" else self.runtime.capture_prefill(bucket)
            self._log("capture_end", bucket=f"{kind}:{bucket}", seconds=s)
            return s
        except BaseException as e:
            self._log("capture_failed", bucket=f"{kind}:{bucket}", error=repr(e))
            raise
        finally:
            self._leave()

    # ------------------------------------------------------------------ steps
    def execute_step(self, plan: Any) -> tuple[Any, float]:
        """Run this rank's part of `plan`; returns (next tokens on TP rank 0 else None, in-rank seconds)."""
        args = plan.rank_args(self.coords.dp_rank)
        if args is None:
            return None, 0.0
        return self._run_step(args, plan.static_tokens, plan.num_steps)

    def _run_step(self, args: tuple, static_tokens: Optional[int], num_steps: int = 1) -> tuple[Any, float]:
        step = self._launch_step(args, static_tokens, num_steps)
        return self._finish_step(step)

    def _launch_step(self, args: tuple, static_tokens: Optional[int], num_steps: int = 1) -> "_Launched":
        """Enqueue one step on the rank's device without waiting for it. An exception names the rank."""
        self._enter("execute")
        self._in_flight += 1
        t0 = time.perf_counter()
        try:
            self._steps += 1
            if self._faults:
                self._maybe_fault_in_step()
            disp = self.runtime.ctx.ep_dispatcher
            cm = disp.static_tokens(static_tokens) if disp is not None else contextlib.nullcontext()
            with cm:
                try:
                    pending = self.runtime.launch(*args, validated=True, num_steps=num_steps)  # checked by the coordinator
                except Exception as e:  # name the rank: compiled-graph errors do not carry the actor
                    raise RankStepError(f"rank {self.rank} ({self.runtime.device}): {type(e).__name__}: {e}") from e
            return _Launched(pending, t0)
        except BaseException:
            self._step_done()
            raise

    def _finish_step(self, step: "_Launched") -> tuple[Any, float]:
        """Wait for a launched step: (next tokens on TP rank 0 else None, seconds since its launch began)."""
        try:
            out = step.pending.result()
            dt = time.perf_counter() - step.t0
            self._step_times.append(dt)
            return (out if self.coords.tp_rank == 0 else None), dt
        finally:
            self._step_done()

    def _step_done(self) -> None:
        self._in_flight -= 1
        if self._in_flight == 0:
            self._leave()

    def start_pipe_loop(self, request_path: str, reply_path: str, trace: bool = False,
                        profile: Optional[str] = None) -> None:
        """Start the resident step loop of the pipe step path (`actors.pipes`): a thread that reads packed
        requests from `request_path` and writes replies to `reply_path` until the driver closes its end.
        The coordinator never overlaps steps with set-up calls, so the loop and this actor's default
        thread do not run device work at the same time. `trace` / `profile`: `DriverOptions.step_trace` /
        `step_profile`."""
        self._step_trace, self._step_profile = trace, profile
        reply = os.open(reply_path, os.O_WRONLY)  # the driver already holds the read end
        thread = threading.Thread(target=self._pipe_loop, args=(request_path, reply), daemon=True,
                                  name=f"graphline-step-loop-{self.rank}")
        thread.start()

    def _pipe_loop(self, request_path: str, reply: int) -> None:
        """Replies go out in request order. A step is launched as soon as its request arrives, even while an
        earlier one still runs on the device (the driver may submit ahead, `Coordinator.submit`); its reply
        is written once its tokens reached the host. Between the two the loop polls both: the oldest
        pending step's event and the request pipe."""
        import torch

        from actors.pipes import read_frame, write_all
        from actors.wire import ARM_NEXT, DISARM, REPLY_ERROR, decode_request, encode_reply, encode_tokens, \
            request_control

        request = os.open(request_path, os.O_RDONLY)  # blocks until the driver opens its end
        if self.device is not None and self.device.type == "cuda":
            self._enter("execute")
            self.runtime.bind_stream()  # this thread runs every step on the forward stream
            self._leave()
        # A GPU rank polls for the next request for a moment after each reply (the driver usually sends it
        # within a millisecond) instead of sleeping in read(): a wake-up from a blocking read costs tens of
        # microseconds on a busy host. CPU ranks always block (their cores run the model).
        spin_s = PIPE_SPIN_S if self.device is not None and self.device.type == "cuda" else 0.0
        pending: deque[Any] = deque()  # _Launched steps, or reply frames (idle steps, errors), in request order

        def error_frame(e: BaseException) -> bytes:
            text = str(e) if isinstance(e, RankStepError) else f"rank {self.rank}: {type(e).__name__}: {e}"
            return encode_reply(REPLY_ERROR, 0.0, text.encode("utf-8", "replace")[:4000])

        def reply_ready() -> None:
            while pending and (isinstance(pending[0], bytes) or pending[0].pending.ready()):
                item = pending.popleft()
                trace = None if isinstance(item, bytes) else item.trace
                if trace is not None:
                    trace["ready"] = time.perf_counter()
                    self._trace.append(trace)  # before the reply: a driver that has it may read the trace
                if not isinstance(item, bytes):
                    try:
                        item = encode_tokens(*self._finish_step(item))
                    except Exception as e:  # noqa: BLE001 - a device error surfaces here
                        item = error_frame(e)
                write_all(reply, item)
                if trace is not None:
                    trace["written"] = time.perf_counter()

        profile_path = self._step_profile if self._step_trace else None
        profiler = None
        if profile_path:  # bench.step_trace --profile: where this thread's host time goes
            import cProfile

            profiler = cProfile.Profile()
            profiler.enable()
        try:
            with torch.inference_mode():  # once for every step this thread runs (`RankRuntime.launch`)
                while True:
                    reply_ready()
                    if pending:  # a step runs: reply when it finishes, unless the next request comes first
                        if not select.select([request], [], [], 0)[0]:
                            continue
                    elif spin_s:
                        deadline = time.perf_counter() + spin_s
                        while time.perf_counter() < deadline and not select.select([request], [], [], 0)[0]:
                            pass
                    body = read_frame(request)
                    if body is None:  # the driver closed the pipe: the step path was torn down
                        return
                    t_read = time.perf_counter()
                    strict = not pending  # nothing in flight: the driver waited for the previous step's tokens
                    control = request_control(body)
                    if control & DISARM:  # no reply: the driver went idle after an arm_next step
                        self.runtime.disarm()
                        continue
                    try:
                        if self._arm_failure is not None:
                            raise self._arm_failure
                        decoded = decode_request(body)
                        if decoded is None:
                            pending.append(encode_tokens(None, 0.0))
                        elif self._step_trace:
                            pending.append(self._launch_traced(decoded, t_read))
                        else:
                            pending.append(self._launch_step(*decoded))
                    except Exception as e:  # noqa: BLE001 - reported to the driver, which tears the group down
                        pending.append(error_frame(e))
                        continue
                    if decoded is None:
                        continue
                    if self.runtime.arms_collectively:  # the driver decides, for every rank alike
                        if control & ARM_NEXT:
                            self._arm_next()
                    elif strict and spin_s and not select.select([request], [], [], 0)[0]:
                        self._arm_next()
        except OSError:
            return  # the driver went away mid-write
        finally:
            if self.runtime is not None:
                self.runtime.disarm()
            if profiler is not None:
                profiler.disable()
                profiler.dump_stats(f"{profile_path}.rank{self.rank}")
            os.close(request)
            os.close(reply)

    def _arm_next(self) -> None:
        """The next request will likely wait for the step just launched: enqueue it now behind a gate, while the
        device runs this one (`actors.armed`). A failure to arm is logged and turns arming off; the step
        already launched is not affected."""
        try:
            self.runtime.arm_next()
        except Exception as e:  # noqa: BLE001
            self._log("arming_failed", error=repr(e))
            if self.runtime.arms_collectively:  # the peers armed: the next cancel would not match theirs
                self._arm_failure = RankStepError(f"rank {self.rank}: arming the next tensor-parallel decode step "
                                                  f"failed ({type(e).__name__}: {e}); its peers armed theirs")
            self.runtime.stop_arming()

    def _launch_traced(self, decoded: tuple, t_read: float) -> "_Launched":
        """`_launch_step` for a decoded request, with a trace record: `read` (request read), `decoded` (this call),
        `call` (timing events made, `_launch_step` called), `launched` (it returned), later `ready` and `written`,
        and `device_s`, the forward stream's time from before the launch to after the tokens' copy (not for a step
        an armed replay took: its device work was enqueued before the request came)."""
        import torch

        t_decoded = time.perf_counter()
        timed = self.device is not None and self.device.type == "cuda"
        if timed:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(self.runtime.stream)
        armed_before = self.runtime.armed_steps
        t_call = time.perf_counter()
        step = self._launch_step(*decoded)
        step.trace = {"read": t_read, "decoded": t_decoded, "call": t_call, "launched": time.perf_counter(),
                      "lane_steps": float(self.runtime.lane_steps), "armed_steps": float(self.runtime.armed_steps)}
        if timed and self.runtime.armed_steps == armed_before:  # an armed step's work was enqueued before `start`
            end.record(self.runtime.stream)
            step.trace["events"] = (start, end)
        return step

    def step_trace(self, clear: bool = False) -> list[dict[str, float]]:
        """The pipe loop's trace records (`DriverOptions.step_trace`), oldest first; perf_counter seconds."""
        out = []
        for rec in self._trace:
            if "written" not in rec:  # its reply is being written
                continue
            rec = dict(rec)
            events = rec.pop("events", None)
            if events is not None:
                rec["device_s"] = events[0].elapsed_time(events[1]) / 1e3
            out.append(rec)
        if clear:
            self._trace.clear()
        return out

    def _maybe_fault_in_step(self) -> None:
        f = self._faults
        if f.get("step_delay_s"):
            time.sleep(float(f["step_delay_s"]))
        if f.get("exit_in_step") == self._steps:
            os._exit(17)
        if f.get("raise_in_step") == self._steps:
            raise _TestFault(f"injected failure in step #{self._steps}")
        if f.get("hang_in_step") == self._steps:
            while True:
                time.sleep(3600)

    def step_times(self, clear: bool = False) -> list[float]:
        out = list(self._step_times)
        if clear:
            self._step_times.clear()
        return out

    # ------------------------------------------------------------------ reset
    def _on_runner_reset(self) -> None:
        """Reset hook: runs inside `runner.reset()` after every graph and plan was dropped, so the
        DeepEP buffer (whose addresses the graphs captured) is destroyed strictly after them."""
        snap = self.runtime.runner.stats.snapshot()
        self._log("reset_graphs", decode_graphs=snap["captured_decode"], prefill_plans=snap["captured_prefill"])
        from parallel.deepep import destroy_deepep_buffer

        self._log("reset_deepep", status=destroy_deepep_buffer())  # collective destroy + barrier, or skipped

    def reset(self) -> list[dict[str, Any]]:
        """graphs (runner.reset) -> DeepEP buffer (its reset hook) -> barrier; returns this reset's events."""
        self._enter("reset")
        try:
            n0 = len(self.events)
            self.runtime.reset()
            if not any(e["kind"] == "reset_graphs" for e in self.events[n0:]):  # no runner yet
                self._on_runner_reset_fallback()
            self.groups.barrier()
            self._log("reset_barrier")
            self._captures = 0
            return self.events[n0:]
        finally:
            self._leave()

    def _on_runner_reset_fallback(self) -> None:
        from parallel.deepep import destroy_deepep_buffer

        self._log("reset_graphs", decode_graphs=0, prefill_plans=0, note="no runner")
        self._log("reset_deepep", status=destroy_deepep_buffer())

    def abort_capture(self) -> dict[str, Any]:
        """Start-up capture failed somewhere: drop whatever this rank captured (no barrier: the
        group may be out of step). Returns the runner stats afterwards."""
        self._enter("abort_capture")
        try:
            if self.runtime is not None and self.runtime.runner is not None:
                self.runtime.reset()
            self._log("capture_aborted")
            self._captures = 0
            return self.runtime.runner.stats.snapshot() if self.runtime.runner is not None else {}
        finally:
            self._leave()

    def reload_weights(self) -> float:
        """After a reset: load the weights again and rebuild the runner around the new model."""
        self._enter("reload_weights")
        try:
            s = self.runtime.load_model()
            early, self._kernel_warm_up = self._kernel_warm_up, None
            if early is not None:
                self.runtime.timings["early_kernel_warm_up_s"] = early.join()
            self.runtime.build_runner()
            self.runtime.runner.add_reset_hook(self._on_runner_reset)
            return s
        finally:
            self._leave()

    def prepare_dispatcher(self) -> None:
        disp = self.runtime.ctx.ep_dispatcher
        if disp is not None:
            disp.prepare()

    def shutdown(self) -> None:
        self._enter("shutdown")
        if self.groups is not None:
            self.groups.destroy()
        self._store = None

    # ------------------------------------------------------------------ health (answers during steps)
    @ray.method(concurrency_group="heartbeat")
    def heartbeat(self) -> dict[str, Any]:
        """The driver's watcher asks this every fraction of a second (`actors.watch`): answered on a thread of
        its own, whatever the rank is doing; no answer means the process is stopped or gone."""
        return {"phase": self.phase, "phase_s": time.time() - self.phase_since, "steps": self._steps}

    @ray.method(concurrency_group="health")
    def health(self) -> dict[str, Any]:
        return {"rank": self.rank, "phase": self.phase, "phase_s": time.time() - self.phase_since,
                "pid": os.getpid(), "steps": self._steps}

    @ray.method(concurrency_group="health")
    def info(self) -> dict[str, Any]:
        out: dict[str, Any] = {"rank": self.rank, "bundle": self.bundle, "pid": os.getpid(), "phase": self.phase,
                               "steps": self._steps, "device": str(self.device) if self.device else None}
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
        times = list(self._step_times)
        out["in_rank_step_ms_mean"] = 1e3 * sum(times) / len(times) if times else None
        return out

    @ray.method(concurrency_group="health")
    def event_log(self) -> list[dict[str, Any]]:
        return list(self.events)

    @ray.method(concurrency_group="health")
    def _test_set_faults(self, **faults: Any) -> None:
        """Tests only: fail_capture_at=N (raise in the N-th capture), exit_in_step=N (os._exit in the
        N-th step), raise_in_step=N (raise in the N-th step), hang_in_step=N (sleep forever in the N-th step),
        step_delay_s=x (sleep in each step), kernels_override=KernelOptions (what `init_groups` cross-checks in place
        of the config's)."""
        self._faults.update(faults)

    def _test_record_logits(self) -> None:
        """Tests only: keep the fp32 logits of every execute (the runtime's logits observer)."""

        def recording(logits):
            self._last_logits = logits.detach().float().cpu().numpy()

        self.runtime.logits_observer = recording

    def _test_stop_recording_logits(self) -> None:
        """Tests only: drop the logits observer (greedy steps take the greedy LM head again)."""
        self.runtime.logits_observer = None

    def _test_last_logits(self) -> Any:
        return getattr(self, "_last_logits", None)
