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
from actors.batch import BatchError, StepBatch
from actors.decode_state import GREEDY_HEAD, LOGITS_HEAD, PendingTokens, _DecodeLane
from actors.runtime_config import DeviceError, RuntimeConfig, resolve_device  # noqa: F401 (re-exported)
from actors.step_sampler import StepSampler
from graphrunner.capture import end_capture, end_capture_quietly
from graphrunner.runner import CUDAGraphRunner
from graphrunner.stats import ExecPath
from graphrunner.step import ForwardStep
from graphrunner.dispatch import Path as RunnerPath
from modeling.attn_metadata import AttentionMetadata, build_decode_step_host, build_step_from_arrays
from modeling.config import PRESETS
from modeling.dummy import make_dummy_inputs
from modeling.kv_cache import KVCacheSpec, PagedKVCache
from modeling.loader import init_random, load_checkpoint
from modeling.ops import get_kernel_ops
from modeling.qwen3 import Qwen3ForCausalLM
from parallel.context import ParallelContext

class RankRuntime:
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
        # (B, T, global_decode, batch bucket, token bucket) -> the `_DecodeLane` of greedy decode steps of that shape
        self._lanes: dict[tuple, _DecodeLane] = {}
        self.lane_steps = 0  # steps served by a decode lane
        self._last_lane: Optional[_DecodeLane] = None  # the lane of the latest step, if one served it
        self._last_host_ids = False  # whether the latest step's token ids all came from the host
        self._armer: Optional[ArmedDecode] = None  # made by `build_runner` where arming is allowed
        self._sampler: Optional[StepSampler] = None  # the batched sampler of sampled rows (`sampler()`)
        # (chosen, top ids, top logprobs) device tensors of the step being launched, when its batch asks for them
        self._step_logprobs: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None
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
        ops = get_kernel_ops(self.device, self.cfg.kernel_backend, self.cfg.kernels)
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
        its process groups form (`actors.kernel_warm_up`), so here they are usually cached already."""
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
            self.timings["kernel_warm_up_s"] = time.perf_counter() - t0

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
        return bool(snap.get("captured_decode") or snap.get("captured_prefill"))

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
        gather); fp32 logits + their argmax (the eager sampler, logits observers); and the sampler's captured
        variants (`StepSampler.graph_heads`) over the fp32 logits."""
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

        self.runner.register_epilogue(GREEDY_HEAD, greedy, limit)
        self.runner.register_epilogue(LOGITS_HEAD, logits, limit)
        for name, fn in self.sampler().graph_heads(lambda h, b: model.compute_logits(h, rows(b)), max(buckets)):
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
    def execute(self, batch: Optional[StepBatch], global_decode: Optional[bool] = None, batch_bucket: int = 0,
                token_bucket: int = 0, validated: bool = False, num_steps: int = 1) -> Optional[np.ndarray]:
        """Run one forward step and wait for it: `launch(...).result()`."""
        return self.launch(batch, global_decode, batch_bucket, token_bucket, validated, num_steps).result()

    def launch(self, batch: Optional[StepBatch], global_decode: Optional[bool] = None, batch_bucket: int = 0,
               token_bucket: int = 0, validated: bool = False, num_steps: int = 1) -> PendingTokens:
        """Enqueue one forward step on the forward stream and return without waiting for the device; the
        returned `PendingTokens` yields int64 `[B]` next tokens, or None for an idle (dummy) step.

        An idle rank runs a harmless dummy step of the global bucket so collectives pair up.
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
                return self.launch(batch, global_decode, batch_bucket, token_bucket, validated, num_steps)
        lane = None
        if validated and num_steps == 1 and batch is not None:
            lane = self._lanes.get((batch.batch_size, batch.num_tokens, global_decode, batch_bucket, token_bucket))
            if lane is not None and (self.logits_observer is not None or batch.temperature.any()
                                     or batch.extras is not None):
                lane = None
        armer = self._armer
        if armer is not None and armer.armed:
            if lane is None or int(batch.token_ids.min()) < 0:
                armer.cancel()  # before anything below waits on the stream the gate holds
            else:
                pending = armer.take(self.runner, lane, batch, PendingTokens)
                if pending is not None:
                    self._count_lane_step(lane, batch.batch_size)
                    self._last_tokens, self._last_lane, self._last_host_ids = lane.tokens, lane, True
                    return pending
        self._last_lane, self._last_host_ids = None, False
        if lane is not None:
            with self.on_stream():
                ids, ids_dev = self._resolve_ids(batch.token_ids)  # BatchError: nothing ran, nothing counted
                self._count_lane_step(lane, batch.batch_size)
                tokens = self._last_tokens = lane.run(self.runner, ids, ids_dev, batch)
                self._last_lane, self._last_host_ids = lane, ids_dev is None
                return self._read_back(tokens, multi=False)
        with self.on_stream():
            if batch is None:
                for _ in range(num_steps):
                    self._run_dummy(global_decode, batch_bucket, token_bucket)
                return PendingTokens(None)
            if not validated:
                self.check_batch(batch)
                batch.check_multi_step(num_steps, self.cfg.block_size)
            ids, ids_dev = self._resolve_ids(batch.token_ids)
            self._step_logprobs = None
            if num_steps == 1:
                tokens = self._step_tokens(batch, ids, ids_dev, global_decode, batch_bucket, token_bucket)
                self._last_tokens = tokens
                if self._step_logprobs is not None:
                    return self._read_back(tokens, multi=False, logprobs=self._step_logprobs)
            else:
                tokens = self._multi_step_tokens(batch, ids, ids_dev, global_decode, batch_bucket, token_bucket,
                                                 num_steps)
                self._last_tokens = tokens[-1]
            return self._read_back(tokens, multi=num_steps > 1)

    def _count_lane_step(self, lane: _DecodeLane, n: int) -> None:
        self.lane_steps += 1
        self.runner.stats.record_step(ExecPath.FULL_GRAPH, n, lane.key.batch)

    # ---- armed decode (`actors.armed`)
    @property
    def armed_steps(self) -> int:
        """Steps an armed replay took."""
        return 0 if self._armer is None else self._armer.counts["went"]

    def arm_next(self) -> bool:
        """Enqueue the next step of the latest step's decode lane behind a closed gate, on padding rows, after
        whatever the forward stream holds, so that the next request of that shape only has to open it (`launch`
        does). Only after a step a lane or an arm took whose token ids came from the host: a driver that feeds
        back tokens on the device submits ahead, and its next step would only cancel the arm. For a caller that
        expects the next request to wait for this step's tokens (the resident step loop, after a request that
        found no earlier step in flight). Returns whether it armed."""
        lane, armer = self._last_lane, self._armer
        if armer is None or lane is None or armer.armed or not self._last_host_ids:
            return False
        with self.on_stream(), torch.inference_mode():  # no-op inside the step loop's inference mode
            if self._last_tokens is not None:  # a cancelled arm rewrites the head output it views
                self._last_tokens = self._last_tokens.clone()
            armer.arm(self.runner, lane)
        return True

    @property
    def arms_collectively(self) -> bool:
        """Whether this rank arms only when the driver says so (`StepPlan.arm_next`; tensor parallelism)."""
        return self._armer is not None and self._armer.collective

    def stop_arming(self) -> None:
        """Cancel any armed step and never arm again (after a failure to arm)."""
        self.disarm()
        self._armer = None

    def disarm(self) -> None:
        """Cancel an armed step and wait for its padding replay (no-op when none): for anything that is not a
        step launch and may wait on the forward stream or drop the graphs the arm replays."""
        armer = self._armer
        if armer is not None:  # sync even when another thread cancelled it: its padding replay may still run
            armer.cancel()
            self._sync()

    def _read_back(self, tokens: torch.Tensor, multi: bool, logprobs: Optional[tuple] = None) -> PendingTokens:
        if logprobs is not None:  # rarer steps: fresh pinned buffers, no free list
            nb = tokens.device.type == "cuda"
            host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=nb) for t in (tokens, *logprobs)]
            for h, t in zip(host, (tokens, *logprobs)):
                h.copy_(t, non_blocking=nb)
            event = None
            if nb:
                event = torch.cuda.Event()
                event.record(self.stream)
            return PendingTokens(host[0], event, multi, logprobs=tuple(host[1:]))
        if tokens.device.type != "cuda":
            return PendingTokens(tokens.contiguous(), None, multi)
        free = self._read_back_free.setdefault(tuple(tokens.shape), [])
        if free:
            host, event = free.pop()
        else:
            host, event = torch.empty(tokens.shape, dtype=torch.int64, pin_memory=True), torch.cuda.Event()
        host.copy_(tokens, non_blocking=True)
        event.record(self.stream)
        return PendingTokens(host, event, multi, recycle=free)

    def check_batch(self, batch: StepBatch) -> None:
        """Raise `BatchError` for a batch this rank cannot run (before any device work)."""
        batch.check_runnable(self.model_config.vocab_size, self.cfg.block_size, self.cfg.max_blocks_per_seq,
                             self.kv_cache.spec.num_blocks, prev_rows=self.prev_rows)

    @property
    def prev_rows(self) -> int:
        """How many rows of this rank's latest step a negative token id may refer to (0: none)."""
        return 0 if self._last_tokens is None else int(self._last_tokens.shape[0])

    def _resolve_ids(self, ids: np.ndarray) -> tuple[np.ndarray, Optional[torch.Tensor]]:
        """Previous-step references: `ids` int64 `[T]` where `-(j + 1)` stands for row j of this rank's latest
        step's tokens. Returns (host ids with references as 0, device int64 `[T]` ids with references filled in,
        or None when there are none). The fill is enqueued on the forward stream, after the step that made them.
        Raises BatchError (nothing enqueued) for a reference this rank cannot satisfy."""
        if ids.size == 0 or int(ids.min()) >= 0:
            return ids, None
        refs = ids < 0
        src = -ids[refs] - 1
        rows = self.prev_rows
        if rows == 0:
            raise BatchError("a token id refers to the previous step's tokens, but this rank has run no step "
                             "since it started or was reset")
        if int(src.max()) >= rows:
            raise BatchError(f"a token id refers to row {int(src.max())} of the previous step, which had {rows} rows")
        prev = self._last_tokens
        host = np.where(refs, ids, 0)
        n = int(ids.shape[0])
        if refs.all() and np.array_equal(src, np.arange(n)):
            return host, prev[:n]  # the steady state of a decode loop: row i continues row i
        dev = torch.from_numpy(host).to(self.device, non_blocking=True)
        idx = torch.from_numpy(np.stack([np.flatnonzero(refs), src])).to(self.device, non_blocking=True)
        dev.index_copy_(0, idx[0], prev.index_select(0, idx[1]))
        return host, dev

    def _run_dummy(self, global_decode, batch_bucket, token_bucket) -> None:
        decode = global_decode is not False
        n = max(batch_bucket, 1) if decode else max(token_bucket, 1)
        step = self._dummy_step(n, max(batch_bucket, 1) if decode else 1, decode)
        step = dataclasses.replace(step, global_decode=global_decode, batch_bucket_hint=batch_bucket,
                                   token_bucket_hint=token_bucket)
        self.runner(step)

    def _step_tokens(self, batch: StepBatch, ids: np.ndarray, ids_dev: Optional[torch.Tensor], global_decode,
                     batch_bucket, token_bucket) -> torch.Tensor:
        """Enqueue one step; its next tokens, int64 `[B]` on the rank's device (not waited for)."""
        if batch.num_tokens == batch.batch_size and self.device.type == "cuda":
            out = self._decode_fast(batch, ids, ids_dev, global_decode, batch_bucket, token_bucket)
            if out is not None:
                return out
        ids_t, pos, meta = build_step_from_arrays(ids, batch.q_seqlens, batch.num_history, batch.block_tables,
                                                  self.cfg.block_size, self.device)
        step = ForwardStep(ids_t if ids_dev is None else ids_dev, pos, self.kv_cache.layers, meta,
                           global_decode=global_decode, batch_bucket_hint=batch_bucket, token_bucket_hint=token_bucket)
        hidden = self.runner(step)
        sampled = bool(batch.temperature.any()) or batch.extras is not None
        logits, greedy = self._eager_head(hidden, meta.last_token_index, sampled)
        return self._sample(logits, batch) if sampled else greedy

    def _eager_head(self, hidden: torch.Tensor, rows: torch.Tensor, need_logits: bool
                    ) -> tuple[Optional[torch.Tensor], torch.Tensor]:
        """The LM head without a graph: (fp32 logits `[n, V]` when `need_logits` (the caller samples) or a logits
        observer is set, else None; int64 greedy tokens `[n]`, None when `need_logits`). Calls the observer."""
        if not need_logits and self.logits_observer is None:
            return None, self.model.greedy_tokens(hidden, rows)
        logits = self.model.compute_logits(hidden, rows)
        if self.logits_observer is not None:
            self.logits_observer(logits)
        return logits, None if need_logits else logits.argmax(dim=-1)

    def _decode_fast(self, batch: StepBatch, ids: np.ndarray, ids_dev: Optional[torch.Tensor], global_decode,
                     batch_bucket, token_bucket) -> Optional[torch.Tensor]:
        """A decode step served by a captured graph: host-side metadata, one host-to-device copy (plus a
        device copy of previous-step token ids), graph replay, then the LM-head graph of the bucket. None when
        the step would not replay a full graph (the caller then takes the general path; nothing was launched)."""
        ids_h, pos, meta = build_decode_step_host(ids, batch.num_history, batch.block_tables, self.cfg.block_size)
        step = ForwardStep(ids_h if ids_dev is None else ids_dev, pos, self.kv_cache.layers, meta,
                           global_decode=global_decode, batch_bucket_hint=batch_bucket, token_bucket_hint=token_bucket)
        sampled = bool(batch.temperature.any()) or batch.extras is not None
        launched = self._decode_graph_step(step, sampled_batch=batch if sampled else None)
        if launched is None:
            return None
        logits, tokens = launched
        if not sampled and self.logits_observer is None:
            self._add_lane(step, global_decode, batch_bucket, token_bucket)
            self._last_host_ids = ids_dev is None
        return self._sample(logits, batch) if logits is not None and sampled else tokens

    def _add_lane(self, step: ForwardStep, global_decode, batch_bucket: int, token_bucket: int) -> None:
        """Remember the graphs that served this greedy decode step, so the next step of the same shape and hints
        skips the dispatch (`_DecodeLane`). Forgotten whenever graphs are captured or dropped."""
        decision = self.runner.decide_decode(step)  # pure: the decision the step just replayed
        if decision.path is not RunnerPath.FULL_GRAPH:
            return
        head = self.runner.epilogue_outputs(decision.decode_key.batch, GREEDY_HEAD)
        if head is None:
            return
        n = step.batch_size
        lane = self._lanes[(n, n, global_decode, batch_bucket, token_bucket)] = _DecodeLane(
            decision.decode_key, head[0], step, self.cfg.block_size)
        self._last_lane = lane

    def _decode_graph_step(self, step: ForwardStep, sampled_batch: Optional[StepBatch] = None
                           ) -> Optional[tuple[Optional[torch.Tensor], Optional[torch.Tensor]]]:
        """Replay the decode graph and an LM-head epilogue for `step` without waiting: (fp32 logits `[n, V]` when
        the caller must still sample or a logits observer is set, else None; int64 tokens `[n]`: greedy, or those
        of `sampled_batch` when a captured sampler head served it, None when the caller samples), device views
        valid until the next step of the bucket. None (nothing launched) when no full graph fits."""
        decision = self.runner.decide_decode(step)
        if decision.path is not RunnerPath.FULL_GRAPH:
            return None
        hidden = self.runner.run(step, decision)
        n, bucket = step.batch_size, decision.decode_key.batch
        run_head = self.runner.replay_epilogue
        if self.logits_observer is None:
            if sampled_batch is None:
                outs = run_head(bucket, GREEDY_HEAD)
                if outs is not None:
                    return None, outs[0][:n]
            else:
                name = self.sampler().stage_graph_rows(sampled_batch, bucket, self.runner.epilogue_outputs)
                if name is not None:
                    return None, run_head(bucket, name)[0][:n]
        outs = run_head(bucket, LOGITS_HEAD)
        if outs is None:
            logits, greedy = self._eager_head(hidden, self._decode_rows(n), sampled_batch is not None)
            return logits, greedy
        logits = outs[0][:n]
        if self.logits_observer is not None:
            self.logits_observer(logits)
        return logits, outs[1][:n]

    def _multi_step_tokens(self, batch: StepBatch, ids: np.ndarray, ids_dev: Optional[torch.Tensor], global_decode,
                           batch_bucket, token_bucket, num_steps: int) -> torch.Tensor:
        """Enqueue `num_steps` greedy decode steps; their tokens, int64 `[num_steps, B]` on the device."""
        sampled = bool(batch.temperature.any())
        if self.device.type == "cuda" and not sampled:
            out = self._decode_multi_on_device(batch, ids, ids_dev, global_decode, batch_bucket, token_bucket,
                                               num_steps)
            if out is not None:
                return out
        # general path: one step at a time, each step's tokens feeding the next on the device
        rows = []
        for _ in range(num_steps):
            toks = self._step_tokens(batch, ids, ids_dev, global_decode, batch_bucket, token_bucket)
            rows.append(toks)
            ids_dev = toks
            batch = dataclasses.replace(batch, num_history=(batch.num_history + 1).astype(np.int32))
        return torch.stack(rows)

    def _decode_multi_on_device(self, batch: StepBatch, ids: np.ndarray, ids_dev: Optional[torch.Tensor],
                                global_decode, batch_bucket, token_bucket, num_steps: int) -> Optional[torch.Tensor]:
        """Multi-step greedy decode on captured graphs: each step's tokens stay on the device and feed the next
        step's graph; positions, slots and lengths of every step are computed on the host up front and copied
        once. Returns int64 `[num_steps, B]` on the device (not waited for), or None: no graph fits."""
        bs, n = self.cfg.block_size, batch.batch_size
        ids_h, pos, meta = build_decode_step_host(ids, batch.num_history, batch.block_tables, bs)
        hints = dict(global_decode=global_decode, batch_bucket_hint=batch_bucket, token_bucket_hint=token_bucket)
        first = self._decode_graph_step(ForwardStep(ids_h if ids_dev is None else ids_dev, pos, self.kv_cache.layers,
                                                    meta, **hints))
        if first is None:
            return None
        dev = self.device
        tokens = torch.empty((num_steps, n), dtype=torch.int64, device=dev)
        tokens[0].copy_(first[1])  # greedy only: sampled batches take the per-step path
        later = batch.num_history.astype(np.int64)[None, :] + np.arange(1, num_steps, dtype=np.int64)[:, None]
        slots = batch.block_tables[np.arange(n)[None, :], later // bs].astype(np.int64) * bs + later % bs
        host = torch.from_numpy(np.stack([later, slots, later + 1])).pin_memory()
        pos_d, slot_d, kv64 = host.to(dev, non_blocking=True).unbind(0)
        kv_d = kv64.to(torch.int32)
        tables = torch.from_numpy(np.require(batch.block_tables, np.int32, ("C", "W"))).pin_memory()
        tables = tables.to(dev, non_blocking=True)
        ones = torch.ones(n, dtype=torch.int32, device=dev)
        rows32 = torch.arange(n, dtype=torch.int32, device=dev)
        rows64 = self._decode_rows(n)
        for j in range(1, num_steps):
            step_meta = AttentionMetadata(
                is_decoding=True, q_seqlens=ones, kv_seqlens=kv_d[j - 1], q_start_loc=rows32, block_tables=tables,
                slot_mapping=slot_d[j - 1], last_token_index=rows64, max_q_seqlen=1,
                max_kv_seqlen=int(batch.num_history.max()) + j + 1, block_size=bs)
            launched = self._decode_graph_step(ForwardStep(tokens[j - 1], pos_d[j - 1], self.kv_cache.layers,
                                                           step_meta, **hints))
            if launched is None:  # cannot happen for a batch whose first step replayed a graph
                raise RuntimeError("multi-step decode lost its decode graph mid-way")
            tokens[j].copy_(launched[1])
        return tokens

    def sampler(self) -> StepSampler:
        """This rank's batched sampler (`actors.step_sampler`), made at first use."""
        if self._sampler is None:
            self._sampler = StepSampler(self.device, self.model_config.vocab_size, self.cfg.max_model_len)
        return self._sampler

    def _sample(self, logits: torch.Tensor, batch: StepBatch) -> torch.Tensor:
        """The eager batched sampler over fp32 logits `[n, V]`; the step's logprobs, when its batch asks for them,
        wait in `_step_logprobs` for the read-back."""
        tokens, self._step_logprobs = self.sampler().sample(logits, batch)
        return tokens

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
