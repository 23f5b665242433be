"""`RankRuntime`: one rank's device, model shard, paged KV cache and graph runner. Ray-free.

Executes one `StepBatch` per call (numpy in, next tokens out), runs start-up capture one
bucket at a time (the coordinator drives buckets in lock-step), and resets. All device
work runs on the runtime's forward stream (the current stream of the rank's device).
"""
from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from typing import Any, Callable, Optional

import numpy as np
import torch

from actors.armed import ArmedDecode
from actors.batch import StepBatch
from actors.decode_state import GREEDY_HEAD, LOGITS_HEAD, PendingTokens, _DecodeLane
from actors.protocol import NO_HINTS, StepHints
from actors.rank_decode import RankDecodeSteps
from actors.rank_io import RankStepIO
from actors.runtime_config import DeviceError, RuntimeConfig, resolve_device  # noqa: F401 (re-exported)
from actors.step_sampler import StepSampler
from graphrunner.runner import CUDAGraphRunner
from graphrunner.stats import ExecPath
from graphrunner.step import ForwardStep
from modeling.config import PRESETS
from modeling.dummy import make_dummy_inputs
from modeling.kv_cache import KVCacheSpec, PagedKVCache
from modeling.loader import init_random, load_checkpoint
from modeling.ops import get_kernel_ops
from modeling.qwen3 import Qwen3ForCausalLM
from parallel.context import ParallelContext

class RankRuntime(RankDecodeSteps, RankStepIO):
    """Owns one rank's model shard, KV cache and graph runner (lifetime: the rank's process)."""

    def __init__(self, cfg: RuntimeConfig, ctx: ParallelContext, device: torch.device):
        self.cfg = cfg
        self.ctx = ctx
        self.device = device
        # All device work runs on one forward stream (capture is illegal on the legacy default stream);
        # each entry point enters it, so whichever thread Ray calls from, the runner sees its own stream.
        self.stream = None
        if device.type == "cuda":
            torch.cuda.set_device(device)
            self.stream = torch.cuda.Stream(device)
        self.model_config = cfg.model_config(device)
        self.model: Optional[Qwen3ForCausalLM] = None
        self.kv_cache: Optional[PagedKVCache] = None
        self.runner: Optional[CUDAGraphRunner] = None
        self.timings: dict[str, float] = {}
        self._rows: Optional[torch.Tensor] = None  # int64 arange on the device: the last-token rows of a decode step
        # Tests: called with each step's fp32 logits `[B, V]` (a device view, valid during the call), whichever
        # path produced them (eager LM head or the captured head graph).
        self.logits_observer: Optional[Callable[[torch.Tensor], None]] = None
        # The tokens of this rank's latest real step (device int64 `[B]`, the last step's column for multi-step
        # decode): what a negative token id of the next batch refers to (`StepBatch` "previous-step references").
        # A view of a head graph's output or a step's own tensor, valid until a later step of the stream writes it.
        self._last_tokens: Optional[torch.Tensor] = None
        # Read-back buffers by token shape: (pinned int64 host tensor, event) pairs whose step was collected
        self._read_back_free: dict[tuple, list] = {}
        # (B, T, StepHints) -> the `_DecodeLane` of greedy decode steps of that shape under those hints
        self._lanes: dict[tuple, _DecodeLane] = {}
        self.lane_steps = 0  # steps served by a decode lane
        self._last_lane: Optional[_DecodeLane] = None  # the lane of the latest step, if one served it
        self._last_host_ids = False  # whether the latest step's token ids all came from the host
        self._last_head = None  # the `GraphHead` of the captured sampler head the latest step took, if one did
        self._armer: Optional[ArmedDecode] = None  # made by `build_runner` where arming is allowed
        self._sampler: Optional[StepSampler] = None  # the batched sampler of sampled rows (`sampler()`)
        # the step being launched's tokens and logprobs when its batch asks for N of them: (int32 `[n, 2 + 2M]` on the
        # device, packed by `actors.step_sampler.pack_logprobs` with M >= N top entries, N)
        self._step_logprobs: Optional[tuple[torch.Tensor, int]] = None
        # the latest step's prompt log-probabilities (device tensors, `actors.rank_prompt_logprobs`), when asked
        self._step_prompt: Optional[tuple[torch.Tensor, ...]] = None
        self._thread = threading.local()  # `.bound`: this thread's current stream is `self.stream` (`bind_stream`)

    def on_stream(self):
        """Run on the forward stream: a context that makes it current (nothing to do on a bound thread)."""
        if self.stream is None or getattr(self._thread, "bound", False):
            return contextlib.nullcontext()
        return torch.cuda.stream(self.stream)

    def bind_stream(self) -> None:
        """Make the forward stream current on the calling thread for good (a rank's resident step loop), so each
        step skips switching streams. Code on that thread must restore any stream it switches to."""
        if self.stream is not None:
            torch.cuda.set_stream(self.stream)
            self._thread.bound = True

    # ---- start-up
    def load_model(self) -> float:
        self.disarm()
        t0 = time.perf_counter()
        ops = get_kernel_ops(self.device, self.cfg.kernel_backend,
                             self.cfg.kernels.for_model(self.model_config.hidden_size))
        with torch.device(self.device), self.on_stream():
            model = Qwen3ForCausalLM(self.model_config, self.ctx, self.device, ops)
            if self.cfg.model in PRESETS:
                init_random(model, self.cfg.seed)
            else:
                load_checkpoint(model, self.cfg.model)
        self.model = model.eval()
        self._sync()
        self.timings["weights_s"] = time.perf_counter() - t0
        return self.timings["weights_s"]

    def weight_bytes(self) -> int:
        seen, total = set(), 0
        for p in self.model.parameters():
            if p.data_ptr() not in seen:
                seen.add(p.data_ptr())
                total += p.numel() * p.element_size()
        return total

    def kv_blocks_for_budget(self) -> int:
        if self.cfg.num_kv_blocks is not None:
            return self.cfg.num_kv_blocks
        if self.device.type != "cuda":
            return 512
        free, _ = torch.cuda.mem_get_info(self.device)
        spec = KVCacheSpec.from_memory_budget(self.model_config, int(free * self.cfg.kv_cache_memory_fraction),
                                              self.cfg.block_size, self.ctx.tp_size)
        return spec.num_blocks

    def allocate_kv_cache(self, num_blocks: Optional[int] = None) -> int:
        """Allocate the arenas; the runner must be reset first if one exists (captured addresses)."""
        if self.runner is not None and self.runner_has_graphs():
            raise RuntimeError("reset the graph runner before reallocating the KV cache")
        self.disarm()
        n = num_blocks if num_blocks is not None else self.kv_blocks_for_budget()
        self.kv_cache = None
        spec = KVCacheSpec.for_model(self.model_config, n, self.cfg.block_size, self.ctx.tp_size)
        with self.on_stream():
            self.kv_cache = PagedKVCache(spec, self.device)
        self._sync()
        return n

    def build_runner(self) -> None:
        """A graph runner over the model and KV cache (captures nothing yet). Also compiles every attention kernel
        variant serving can pick, side by side on threads (`Qwen3ForCausalLM.warm_up_kernels`): a compile
        mid-serving stalls every request of the step for about a second. A worker starts these compiles before
        its process groups form (`actors.kernel_warm_up`), so here they are usually cached already. Then the
        eager sampler's variant classes (`warm_up_sampler`; `cfg.sampler_warm_up`), in lock-step under TP."""
        self._forget_lanes()
        self.runner = CUDAGraphRunner(
            self.model, self.cfg.graph, self.device, self._dummy_step, self.cfg.max_blocks_per_seq, stream=self.stream,
        )
        self._register_heads()
        if self.device.type == "cuda":
            t0 = time.perf_counter()
            with torch.inference_mode(), self.on_stream():
                self.model.warm_up_kernels(self.kv_cache.layers)
                self._armer = self._make_armer()
                t1 = time.perf_counter()
                if self.cfg.sampler_warm_up:
                    self.warm_up_sampler()
            self.timings["kernel_warm_up_s"] = time.perf_counter() - t0
            self.timings["sampler_warm_up_s"] = time.perf_counter() - t1

    def _make_armer(self) -> Optional[ArmedDecode]:
        """The armed-decode state of this rank, or None where it may not arm (see `RuntimeConfig`); compiles the
        gate kernel now rather than at the first arm."""
        wait_s = self.cfg.armed_decode_wait_ms / 1e3
        if wait_s <= 0 or self.ctx.ep_size != 1 or self.device.type != "cuda":
            return None
        armer = ArmedDecode(self.device, wait_s, collective=self.ctx.tp_size > 1)
        armer.gate.warm_up()
        return armer

    def runner_has_graphs(self) -> bool:
        snap = self.runner.stats.snapshot()
        return bool(snap.get("captured_decode") or snap.get("captured_prefill") or snap.get("captured_prefill_graphs"))

    def capture_sizes(self) -> tuple[list[int], list[int]]:
        return list(self.runner.decode_capture_sizes()), list(self.runner.prefill_capture_sizes())

    def capture_decode(self, batch: int) -> float:
        """Capture the decode graph of bucket `batch` and its LM-head epilogues; returns seconds."""
        self._forget_lanes()  # a new bucket may change which graph serves a batch size
        with self.on_stream():
            t0 = time.perf_counter()
            self.runner.capture_decode(batch)
            return time.perf_counter() - t0

    def _register_heads(self) -> None:
        """The LM head as decode epilogues the runner captures on each decode bucket up to `head_graph_max_batch`
        (`graphrunner.epilogue`): greedy tokens alone (`greedy_tokens`: no fp32 logits, under TP no logits
        gather); fp32 logits + their argmax (the eager sampler, logits observers; under TP this rank's vocabulary
        shard and the greedy tokens); and the sampler's captured variants (`StepSampler.graph_heads`) over the
        fp32 logits (under TP the shard: the sampler combines per-shard statistics, never the logits)."""
        limit = self.cfg.head_graph_max_batch
        buckets = [b for b in self.runner.decode_capture_sizes() if b <= limit]
        if not buckets or self.device.type != "cuda" or self.cfg.graph.eager_mode:
            return
        model, rows = self.model, self._decode_rows

        def greedy(hidden: torch.Tensor, b: int) -> tuple:
            return (model.greedy_tokens(hidden, rows(b)),)

        def logits(hidden: torch.Tensor, b: int) -> tuple:
            lg = model.compute_logits(hidden, rows(b))
            return lg, lg.argmax(dim=-1)

        def shard_logits(hidden: torch.Tensor, b: int) -> tuple:  # TP: no fp32 logits gathered
            return model.compute_logits_shard(hidden, rows(b)), model.greedy_tokens(hidden, rows(b))

        tp = self.ctx.tp_size > 1
        self.runner.register_epilogue(GREEDY_HEAD, greedy, limit)
        self.runner.register_epilogue(LOGITS_HEAD, shard_logits if tp else logits, limit)
        logits_fn = model.compute_logits_shard if tp else model.compute_logits
        for name, fn in self.sampler().graph_heads(lambda h, b: logits_fn(h, rows(b)), max(buckets)):
            self.runner.register_epilogue(name, fn, limit)

    def _decode_rows(self, n: int) -> torch.Tensor:
        if self._rows is None or self._rows.shape[0] < n:
            self._rows = torch.arange(max(n, self.runner.graph_meta.max_batch_size), dtype=torch.int64,
                                      device=self.device)
        return self._rows[:n]

    def _forget_lanes(self) -> None:
        """Cancel any arm and drop every decode lane (their graphs are about to change or go)."""
        self.disarm()
        self._last_lane = None
        self._lanes.clear()

    def capture_prefill(self, tokens: int) -> float:
        self.disarm()
        with self.on_stream():
            return self.runner.capture_prefill(tokens)

    def capture_all(self, progress: bool = False) -> dict[str, float]:
        """Capture every decode bucket, then every prefill bucket, in the runner's order (one rank in this
        process; a multi-rank group is driven bucket by bucket in lock-step by the coordinator instead).
        Returns seconds per bucket ("decode:8", "prefill:512", ...) and sets `timings["capture_s"]`."""
        t0 = time.perf_counter()
        decode, prefill = self.capture_sizes()
        jobs = [("decode", b, self.capture_decode) for b in decode] + [("prefill", t, self.capture_prefill) for t in prefill]
        bar = None
        if progress and jobs:
            from tqdm import tqdm

            bar = tqdm(total=len(jobs), desc="capturing", unit="graph", leave=True)
        seconds: dict[str, float] = {}
        try:
            for kind, size, capture in jobs:
                if bar is not None:
                    bar.set_postfix_str(f"{kind} {size}")
                seconds[f"{kind}:{size}"] = capture(size)
                if bar is not None:
                    bar.update(1)
        finally:
            if bar is not None:
                bar.close()
        self.timings["capture_s"] = time.perf_counter() - t0
        return seconds

    def _dummy_step(self, num_tokens: int, batch_size: int, is_decoding: bool) -> ForwardStep:
        ids, pos, meta = make_dummy_inputs(num_tokens, batch_size, is_decoding, self.cfg.block_size,
                                           self.cfg.max_blocks_per_seq, self.device)
        return ForwardStep(ids, pos, self.kv_cache.layers, meta)

    # ---- steps
    @torch.inference_mode()
    def execute(self, batch: Optional[StepBatch], hints: StepHints = NO_HINTS, *, validated: bool = False,
                num_steps: int = 1) -> Optional[np.ndarray]:
        """Run one forward step and wait for it: `launch(...).result()`."""
        return self.launch(batch, hints, validated=validated, num_steps=num_steps).result()

    def launch(self, batch: Optional[StepBatch], hints: StepHints = NO_HINTS, *, validated: bool = False,
               num_steps: int = 1) -> PendingTokens:
        """Enqueue one forward step on the forward stream and return without waiting for the device; the
        returned `PendingTokens` yields int64 `[B]` next tokens, or None for an idle (dummy) step.

        `hints`: the coordinator's phase and buckets for this step (`StepPlan.rank_args`; the default: this rank
        decides alone). An idle rank (batch None) runs a harmless dummy step of the global bucket so collectives
        pair up.
        `validated=True` skips the batch checks when the caller (the coordinator) already ran
        `StepBatch.check_runnable` on the driver, so the per-step hot path does them once; previous-step
        references (negative token ids) are always checked here, against this rank's own last step.
        `num_steps > 1` (multi-step decode, greedy decode batches only): run that many decode steps
        back to back, each fed the previous step's tokens, and yield int64 `[B, num_steps]`; the
        block tables must already cover `num_history + num_steps` tokens (`StepBatch.check_multi_step`).
        Steps launched back to back run in order; a later step may refer to an earlier one's tokens
        before they reached the host (that is what lets a driver keep the device busy).
        """
        if not torch.is_inference_mode_enabled():  # a resident step loop enters it once for all its steps
            with torch.inference_mode():
                return self.launch(batch, hints, validated=validated, num_steps=num_steps)
        lane, greedy = None, False
        if validated and num_steps == 1 and batch is not None and batch.prompt_lp is None:
            lane = self._lanes.get((batch.batch_size, batch.num_tokens, hints))
            greedy = lane is not None and not (self.logits_observer is not None or batch.temperature.any()
                                               or batch.extras is not None)
        armer = self._armer
        if armer is not None and armer.armed:
            pending = self._take_arm(armer, lane, greedy, batch)  # or cancel it: before anything below waits
            if pending is not None:
                return pending
        self._last_lane, self._last_host_ids, self._last_head = None, False, None
        if greedy:
            with self.on_stream():
                ids, ids_dev = self._resolve_ids(batch.token_ids)  # BatchError: nothing ran, nothing counted
                self._count_lane_step(lane, batch.batch_size)
                tokens = self._last_tokens = lane.run(self.runner, ids, ids_dev, batch)
                self._last_lane, self._last_host_ids = lane, ids_dev is None
                return self._read_back(tokens, multi=False)
        with self.on_stream():
            if batch is None:
                for _ in range(num_steps):
                    self._run_dummy(hints)
                return PendingTokens(None)
            if not validated:
                self.check_batch(batch)
                batch.check_multi_step(num_steps, self.cfg.block_size)
            ids, ids_dev = self._resolve_ids(batch.token_ids)
            self._step_logprobs = self._step_prompt = None
            if num_steps == 1:
                tokens = self._step_tokens(batch, ids, ids_dev, hints)
                self._last_tokens = tokens
                if self._step_logprobs is not None or self._step_prompt is not None:
                    return self._read_back(tokens, multi=False, logprobs=self._step_logprobs,
                                           prompt=self._step_prompt)
            else:
                tokens = self._multi_step_tokens(batch, ids, ids_dev, hints, num_steps)
                self._last_tokens = tokens[-1]
            return self._read_back(tokens, multi=num_steps > 1)

    def _count_lane_step(self, lane: _DecodeLane, n: int) -> None:
        self.lane_steps += 1
        self.runner.stats.record_step(ExecPath.FULL_GRAPH, n, lane.key.batch)

    def check_batch(self, batch: StepBatch) -> None:
        """Raise `BatchError` for a batch this rank cannot run (before any device work)."""
        batch.check_runnable(self.model_config.vocab_size, self.cfg.block_size, self.cfg.max_blocks_per_seq,
                             self.kv_cache.spec.num_blocks, prev_rows=self.prev_rows)

    @property
    def prev_rows(self) -> int:
        """How many rows of this rank's latest step a negative token id may refer to (0: none)."""
        return 0 if self._last_tokens is None else int(self._last_tokens.shape[0])

    def _run_dummy(self, hints: StepHints) -> None:
        """An idle rank's step: a dummy decode of the batch bucket, or a dummy prefill of the token bucket when
        the global phase is prefill (`hints.global_decode` False)."""
        decode = hints.global_decode is not False
        n = max(hints.batch_bucket, 1) if decode else max(hints.token_bucket, 1)
        step = self._dummy_step(n, max(hints.batch_bucket, 1) if decode else 1, decode)
        step = dataclasses.replace(step, global_decode=hints.global_decode, batch_bucket_hint=hints.batch_bucket,
                                   token_bucket_hint=hints.token_bucket)
        self.runner(step)

    def reset(self) -> None:
        """Drop every graph and plan (the runner's reset also runs its hooks, e.g. DeepEP teardown) and this
        rank's previous-step tokens."""
        self._forget_lanes()
        self._last_tokens = None
        if self.runner is not None:
            with self.on_stream():
                self.runner.reset()

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {"device": str(self.device), "timings": dict(self.timings)}
        if self.runner is not None:
            out["runner"] = self.runner.stats.snapshot()
            out["head_graphs"] = self.runner.epilogue_stats()
            out["decode_lane_steps"] = self.lane_steps
            if self._armer is not None:
                out["armed_decode"] = dict(self._armer.counts)
        if self.kv_cache is not None:
            out["kv_blocks"] = self.kv_cache.spec.num_blocks
            out["kv_bytes"] = self.kv_cache.nbytes
        if self.device.type == "cuda":
            out["memory_allocated"] = torch.cuda.memory_allocated(self.device)
            out["memory_reserved"] = torch.cuda.memory_reserved(self.device)
        return out

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
