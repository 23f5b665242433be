"""`RankStepIO`: the host-facing half of a `actors.rank.RankRuntime` step, a mixin over its state: the read-back
of a step's tokens (pinned buffers recycled per shape, an event on the forward stream), previous-step token
references resolved on the device, and armed decode (`actors.armed`: the next decode step, greedy or taken by a
captured sampler head, enqueued behind a gate)."""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from actors.batch import BatchError
from actors.decode_state import PendingTokens


class RankStepIO:
    # ---- armed decode (`actors.armed`)
    @property
    def armed_steps(self) -> int:
        """Steps an armed replay took."""
        return 0 if self._armer is None else self._armer.counts["went"]

    def arm_next(self) -> bool:
        """Enqueue the next step of the latest step's decode lane behind a closed gate, on padding rows, after
        whatever the forward stream holds, so that the next request of that shape only has to open it (`launch`
        does), with the LM head that step took (greedy, or its captured sampler head: `_last_head`). Only after a step a
        lane, an arm or a captured sampler head took whose token ids came from the host: a driver that feeds
        back tokens on the device submits ahead, and its next step would only cancel the arm. For a caller that
        expects the next request to wait for this step's tokens (the resident step loop, after a request that
        found no earlier step in flight). Returns whether it armed."""
        lane, armer = self._last_lane, self._armer
        if armer is None or lane is None or armer.armed or not self._last_host_ids:
            return False
        head = self._last_head  # a sampled step arms with the captured sampler head it took
        with self.on_stream(), torch.inference_mode():  # no-op inside the step loop's inference mode
            if self._last_tokens is not None:  # a cancelled arm rewrites the head output it views
                self._last_tokens = self._last_tokens.clone()
            armer.arm(self.runner, lane, head, self.sampler().head_params(head))
        return True

    def _take_arm(self, armer, lane, greedy: bool, batch) -> Optional[PendingTokens]:
        """A step launch while armed: the step's `PendingTokens` when the arm took it (a decode step with host
        ids of a known lane: greedy, or sampled by the very sampler head the arm replays), else None with the arm
        cancelled (`ArmedDecode.take`) and the step for the usual path. Every rank of a TP group decides alike:
        from the request and the captured graphs alone."""
        if lane is None or self.logits_observer is not None or int(batch.token_ids.min()) < 0:
            armer.cancel()
            return None
        head = rows = key = None
        if not greedy:
            try:
                need = self.sampler().graph_head(batch, lane.key.batch, self.runner.epilogue_outputs)
            except BaseException:
                armer.cancel()
                raise
            if need is None:  # the eager sampler's step
                armer.cancel()
                return None
            head, rows, key = need
        pending = armer.take(self.runner, lane, batch, PendingTokens, head, rows, rows_key=key)
        if pending is not None:
            self._count_lane_step(lane, batch.batch_size)
            tokens = lane.tokens if head is None else \
                self.runner.epilogue_outputs(lane.key.batch, head.name)[0][:batch.batch_size]
            self._last_tokens, self._last_lane, self._last_host_ids, self._last_head = tokens, lane, True, head
        return pending

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

    def _read_back(self, tokens: torch.Tensor, multi: bool, logprobs: Optional[tuple[torch.Tensor, int]] = None,
                   prompt: Optional[tuple[torch.Tensor, ...]] = None) -> PendingTokens:
        """`logprobs`: (the step's tokens and logprobs packed, int32 `[n, 2 + 2M]`, N of the M to keep): read back
        in one copy instead of `tokens`. `prompt`: the step's prompt log-probabilities (device tensors), copied to
        fresh pinned buffers before the tokens (not recycled: steps that ask for them are rare)."""
        if prompt is not None:
            return self._read_back_prompt(tokens, multi, logprobs, prompt)
        if logprobs is not None:
            packed, k = logprobs
            if packed.device.type != "cuda":  # the eager sampler's own output: nothing else writes it
                return PendingTokens(packed, None, multi, logprobs=k)
            free = self._read_back_free.setdefault(("logprobs", tuple(packed.shape)), [])  # pinned, per shape
            if free:
                host, event = free.pop()
            else:
                host, event = torch.empty(packed.shape, dtype=torch.int32, pin_memory=True), torch.cuda.Event()
            host.copy_(packed, non_blocking=True)
            event.record(self.stream)
            return PendingTokens(host, event, multi, recycle=free, logprobs=k)
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

    def _read_back_prompt(self, tokens: torch.Tensor, multi: bool, logprobs: Optional[tuple[torch.Tensor, int]],
                          prompt: tuple[torch.Tensor, ...]) -> PendingTokens:
        """`_read_back` of a step with prompt log-probabilities: each tensor, and then the tokens (or the packed tokens
        and logprobs), copied to a fresh pinned buffer behind one event (CPU ranks: as they are)."""
        packed, k = logprobs if logprobs is not None else (tokens, None)
        if packed.device.type != "cuda":
            return PendingTokens(packed.contiguous(), None, multi, logprobs=k, prompt=prompt)
        hosts = tuple(torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in prompt)
        for h, t in zip(hosts, prompt):
            h.copy_(t, non_blocking=True)
        prompt = hosts
        host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
        host.copy_(packed, non_blocking=True)
        event = torch.cuda.Event()
        event.record(self.stream)
        return PendingTokens(host, event, multi, logprobs=k, prompt=prompt)

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
        host = np.where(refs, 0, ids)
        n = int(ids.shape[0])
        if refs.all() and np.array_equal(src, np.arange(n)):
            return host, prev[:n]  # the steady state of a decode loop: row i continues row i
        dev = torch.from_numpy(host).to(self.device, non_blocking=True, copy=True)  # a CPU rank keeps `host`
        idx = torch.from_numpy(np.stack([np.flatnonzero(refs), src])).to(self.device, non_blocking=True)
        dev.index_copy_(0, idx[0], prev.index_select(0, idx[1]))
        return host, dev
