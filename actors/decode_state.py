"""The decode path's per-step state objects of `actors.rank.RankRuntime`: the names of the LM-head epilogues
the rank registers with its graph runner, a launched step's tokens on their way to the host (`PendingTokens`),
a greedy decode shape whose graphs are known (`_DecodeLane`), and `forward_step`: the graph runner's
`ForwardStep` of a rank step under the coordinator's `StepHints` (graphrunner knows no `StepHints`)."""
from __future__ import annotations

from typing import Any, Optional

import numpy as np
import torch

from actors.batch import SampledTokens, StepBatch, StepLogprobs
from actors.prompt_logprobs import PromptLogprobs
from actors.protocol import StepHints
from graphrunner.runner import CUDAGraphRunner
from graphrunner.step import ForwardStep
from modeling.attn_metadata import build_decode_step_host

GREEDY_HEAD = "greedy"  # decode epilogue: int64 greedy tokens `[bucket]`
LOGITS_HEAD = "logits"  # decode epilogue: fp32 logits `[bucket, V]` (under TP the rank's shard) and greedy tokens


def forward_step(input_ids: torch.Tensor, position_ids: torch.Tensor, kv_caches: Any, attn_metadata: Any,
                 hints: StepHints) -> ForwardStep:
    """`ForwardStep(input_ids, position_ids, kv_caches, attn_metadata)` with `hints` as its `global_decode`,
    `batch_bucket_hint` and `token_bucket_hint`."""
    return ForwardStep(input_ids, position_ids, kv_caches, attn_metadata, global_decode=hints.global_decode,
                       batch_bucket_hint=hints.batch_bucket, token_bucket_hint=hints.token_bucket)


class PendingTokens:
    """The next tokens of a launched step on their way to the host.

    `host`: int64 tensor on the host (pinned for a CUDA rank) that a device-to-host copy on the rank's forward
    stream fills, `[B]` or `[num_steps, B]` for multi-step decode; when the step returns N logprobs (`logprobs`
    = N), int32 `[B, 2 + 2M]` instead, tokens and logprobs packed (`unpack_logprobs`, M >= N); `event`: recorded
    after that copy (None when
    the tokens are already on the host: CPU ranks, idle steps). Lifetime: owned by the caller; `result()` returns
    a copy and then hands the pinned buffer and its event back to `recycle` (the rank's free list) for a later
    step, so `result()` is the only reader of `host`. `prompt`: the step's prompt log-probabilities on the host
    (`actors.rank_prompt_logprobs.prompt_logprobs`'s four tensors, copied before `event`), None when not asked."""

    __slots__ = ("host", "event", "multi", "_recycle", "_out", "logprobs", "prompt")

    def __init__(self, host: Optional[torch.Tensor], event: Any = None, multi: bool = False,
                 recycle: Optional[list] = None, logprobs: Optional[int] = None,
                 prompt: Optional[tuple[torch.Tensor, ...]] = None):
        self.host, self.event, self.multi, self._recycle, self._out = host, event, multi, recycle, None
        self.logprobs = logprobs  # N when the step returns N logprobs (`host` is packed)
        self.prompt = prompt

    def ready(self) -> bool:
        """Whether `result()` returns without waiting for the device."""
        return self.event is None or self._out is not None or self.event.query()

    def result(self) -> Optional[np.ndarray | SampledTokens]:
        """int64 `[B]` (`[B, num_steps]` for multi-step decode) next tokens, `SampledTokens` when the step returns
        logprobs, or None for an idle step."""
        if self._out is not None or self.host is None:
            return self._out
        if self.event is not None:
            self.event.synchronize()
        out = self.host.numpy()
        if self.logprobs is not None:
            self._out = unpack_logprobs(out.copy(), self.logprobs)
        else:
            self._out = out.T.copy() if self.multi else out.copy()
        if self.prompt is not None:
            o = self._out
            toks, lp = (o.tokens, o.logprobs) if self.logprobs is not None else (o, None)
            self._out = SampledTokens(toks, lp, PromptLogprobs(*(t.numpy().copy() for t in self.prompt)))
        if self._recycle is not None:  # the host buffer was copied out above: hand it back
            self._recycle.append((self.host, self.event))
            self._recycle = None
        return self._out


def unpack_logprobs(packed: np.ndarray, n: int) -> SampledTokens:
    """The `SampledTokens` of a step's tokens and logprobs packed by `actors.step_sampler.pack_logprobs` (int32
    `[B, 2 + 2M]`), keeping the first `n` <= M top entries: views into `packed` (the caller's own copy), the tokens
    int64, the logprobs' fp32 bits as they were packed."""
    m = (packed.shape[1] - 2) // 2
    return SampledTokens(packed[:, 0].astype(np.int64),
                         StepLogprobs(packed[:, 1].view(np.float32), packed[:, 2:2 + n],
                                      packed[:, 2 + m:2 + m + n].view(np.float32)))


class _DecodeLane:
    """A decode step shape (B sequences, the coordinator's hints) whose path is known: the full graph of `key`
    and its greedy-head epilogue, whose output is `head_out` (int64 `[bucket]`); made by a greedy step or by a
    sampled one a captured sampler head took (the same graph), and what an arm replays (`actors.armed`). `run`
    replays them for a new greedy step of that shape without the runner's dispatch: the graph runner's decision
    is a pure function of the shape and hints and of the captured graphs, and a lane lives only while those stay
    (`RankRuntime._forget_lanes` runs on every capture and reset).
    The model's buffer contract is kept: `CUDAGraphRunner.replay_decode` fills the buffers, redirects the context
    and replays."""

    __slots__ = ("key", "head_out", "hints", "tokens", "kv_layers", "block_size")

    def __init__(self, key: Any, head_out: torch.Tensor, step: ForwardStep, hints: StepHints, block_size: int):
        """`step`: the greedy decode step that `key`'s graph and head just served, built under `hints`."""
        self.key, self.head_out, self.hints, self.block_size = key, head_out, hints, block_size
        self.tokens = head_out[:step.batch_size]  # int64 `[B]` view of the head epilogue's output
        self.kv_layers = step.kv_caches

    def replay_head(self, runner: CUDAGraphRunner) -> None:
        """Replay the greedy head epilogue of this lane's bucket (after its decode graph; current stream)."""
        runner.replay_epilogue(self.key.batch, GREEDY_HEAD)

    def run(self, runner: CUDAGraphRunner, ids: np.ndarray, ids_dev: Optional[torch.Tensor],
            batch: StepBatch) -> torch.Tensor:
        """Enqueue the step on the current (forward) stream; its next tokens, int64 `[B]` on the device (a view
        valid until the next step of this bucket)."""
        ids_h, pos, meta = build_decode_step_host(ids, batch.num_history, batch.block_tables, self.block_size)
        step = forward_step(ids_h if ids_dev is None else ids_dev, pos, self.kv_layers, meta, self.hints)
        runner.replay_decode(self.key, step)
        self.replay_head(runner)
        return self.tokens
