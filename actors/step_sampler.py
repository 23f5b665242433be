"""`StepSampler`: one rank's sampling of a step's rows that do not take the greedy head (a temperature above 0,
or sampler extras: min_p, penalties, logit bias, banned ids, allow masks, logprobs), with the batched sampler of
`modeling.sampler` (Triton kernels on CUDA, the torch path on CPU): counter-based noise keyed by (seed, position),
no host loop, no per-row generator, no host sync.

Lifetime: the rank's. The device parameter block (`SamplerParams`) is allocated for `capacity` rows and grown
(a new block) when a larger batch arrives; its list section is sized by the deployment's limits. Stream: the
caller's current stream (the rank's forward stream): the parameters are copied and the kernels launched there.
"""
from __future__ import annotations

from typing import Any, Callable, Iterator, NamedTuple, Optional

import numpy as np
import torch

from actors.batch import StepBatch
from modeling.sampler import SamplerParams, SamplerVariant, sample
from modeling.sampler.host import TEMPERATURE_EPS, HostBatch, host_batch_from_arrays

MAX_BIAS = 300  # = engine.sampling_params.LOGIT_BIAS_MAX_ENTRIES
MAX_BAN = 1040  # stop token ids (at most 1024) and EOS ids, banned while a request is below min_tokens

# the sampler variants captured as LM-head epilogues per decode bucket (`StepSampler.graph_heads`): name ->
# (variant, logprobs: -1 = none, else the top-N the head yields: rows asking for at most that many take it and
# read back their first N); batches that need another stage (logit bias, bans, penalties, top-k above
# TOP_K_FAST) or more logprobs sample eagerly
GRAPH_LOGPROBS = 5
GRAPH_HEADS = {
    "sample": (SamplerVariant(), -1),
    "sample_k": (SamplerVariant(top_k=True), -1),
    "sample_p": (SamplerVariant(top_p=True), -1),
    "sample_kp": (SamplerVariant(top_k=True, top_p=True), -1),
    "sample_lp": (SamplerVariant(), GRAPH_LOGPROBS),
    "sample_k_lp": (SamplerVariant(top_k=True), GRAPH_LOGPROBS),
    "sample_p_lp": (SamplerVariant(top_p=True), GRAPH_LOGPROBS),
    "sample_kp_lp": (SamplerVariant(top_k=True, top_p=True), GRAPH_LOGPROBS),
}
_BY_FLAGS = {(v.top_k, v.top_p, n >= 0): name for name, (v, n) in GRAPH_HEADS.items()}
# the captured head of decode batches whose rows are all greedy and ask for at most `GRAPH_LOGPROBS` logprobs
# (and need no processing): the sampler over a parameter block that is never staged (every row at the greedy
# defaults), so such a step stages nothing on the host; its tokens are the argmax, lowest id on ties
GREEDY_LOGPROBS_HEAD = "greedy_lp"


class GraphHead(NamedTuple):
    """The captured sampler head a sampled decode step takes (`StepSampler.graph_head`): its `GRAPH_HEADS` name
    and the step's logprobs (-1: none; else the top-N the batch reads back of the head's `GRAPH_LOGPROBS`). Two
    steps with equal `GraphHead`s on one decode graph replay the very same head graph on their own rows."""

    name: str
    num_logprobs: int


def pack_logprobs(tokens: torch.Tensor, chosen: torch.Tensor, top_ids: torch.Tensor, top_logprobs: torch.Tensor
                  ) -> torch.Tensor:
    """A step's tokens and logprobs as one int32 `[n, 2 + 2N]` tensor, so that one device-to-host copy reads them
    back: per row the token, the chosen logprob's fp32 bits, the N top ids, the N top logprobs' fp32 bits
    (`actors.decode_state.unpack_logprobs` takes them apart, bit for bit). Capturable (no host sync)."""
    return torch.cat([tokens.to(torch.int32)[:, None], chosen.to(torch.float32).view(torch.int32)[:, None],
                      top_ids.to(torch.int32), top_logprobs.to(torch.float32).view(torch.int32)], dim=1)


class VocabShard(NamedTuple):
    """This TP rank's slice of the vocabulary: logits columns are global ids [offset, offset + width); `widest`
    is every shard's chunking width; `group` the TP process group the sampler's small collectives use."""

    offset: int
    width: int
    widest: int
    group: Any


class StepSampler:
    """`shard`: under TP, the rank's vocabulary shard: the sampler then takes that shard's logits (or slices the
    full row to it) and combines per-shard statistics over `shard.group`, never gathering fp32 logits."""

    def __init__(self, device: torch.device, vocab_size: int, max_model_len: int, capacity: int = 64,
                 shard: Optional[VocabShard] = None):
        self.device, self.vocab_size = device, vocab_size
        self.shard = shard
        self.max_penalty_tokens = max(1, max_model_len)
        self._params: Optional[SamplerParams] = None
        self._capacity = capacity
        self._graph_params: Optional[SamplerParams] = None  # read by the captured sampler heads, by address
        self._greedy_params: Optional[SamplerParams] = None  # the greedy logprob head's: never staged
        # the latest step's captured-head rows: (the key of the inputs they derive from, `_graph_rows`; the
        # `HostBatch`; its variant)
        self._last_rows: Optional[tuple[tuple, HostBatch, SamplerVariant]] = None

    def _params_for(self, n: int) -> SamplerParams:
        if self._params is None or self._params.max_batch < n:
            while self._capacity < n:
                self._capacity *= 2
            self._params = SamplerParams(self._capacity, self.device, max_bias=MAX_BIAS, max_ban=MAX_BAN,
                                         max_penalty_tokens=self.max_penalty_tokens)
        return self._params

    def _shard_args(self) -> dict:
        sh = self.shard
        return {} if sh is None else {"vocab_offset": sh.offset, "tp_group": sh.group, "shard_width": sh.widest}

    def own_columns(self, logits: torch.Tensor) -> torch.Tensor:
        """Under TP: the rank's shard columns of full-row logits `[n, V]` (a view); shard logits pass as they are."""
        sh = self.shard
        if sh is None or logits.shape[1] == sh.width:
            return logits
        return logits[:, sh.offset: sh.offset + sh.width]

    def _host_batch(self, batch: StepBatch) -> HostBatch:
        """The batch's sampling rows, lists and allow mask included, for the eager sampler (the captured heads'
        rows, without lists: `_graph_rows`)."""
        ex = batch.extras
        position = batch.num_history.astype(np.int64) + batch.q_seqlens
        kw = {} if ex is None else dict(min_p=ex.min_p, penalties=ex.penalties, bias_ids=ex.bias_ids,
                                        bias_vals=ex.bias_vals, ban_ids=ex.ban_ids, pen_ids=ex.pen_ids,
                                        pen_counts=ex.pen_counts, allow_bits=ex.allow_bits)
        return host_batch_from_arrays(batch.temperature, batch.top_k, batch.top_p, batch.seeds, position,
                                      vocab_size=self.vocab_size, **kw)

    def _graph_rows(self, batch: StepBatch) -> tuple[HostBatch, SamplerVariant, tuple]:
        """The captured heads' rows of `batch` (no lists), their `HostBatch.variant()`, and the key of the inputs
        they derive from but the positions. A decode loop's next step (the same key, positions moved on) reuses the
        previous step's rows and variant with the new positions (derived once, `HostBatch.with_position`)."""
        ex = batch.extras
        position = batch.num_history.astype(np.int64) + batch.q_seqlens
        arrays = (batch.temperature, batch.top_k, batch.top_p, batch.seeds) if ex is None else \
            (batch.temperature, batch.top_k, batch.top_p, batch.seeds, ex.min_p)
        key = (tuple([(a.dtype, a.shape) for a in arrays]), b"".join([a.tobytes() for a in arrays]))
        last = self._last_rows
        if last is not None and last[0] == key:
            host = last[1].with_position(position)
            if host is not None:
                return host, last[2], key
        host = host_batch_from_arrays(batch.temperature, batch.top_k, batch.top_p, batch.seeds, position,
                                      vocab_size=self.vocab_size, **({} if ex is None else dict(min_p=ex.min_p)))
        # kept for the next step: owning its arrays (top_p and min_p may view the caller's)
        host.top_p, host.min_p = host.top_p.copy(), host.min_p.copy()
        variant = host.variant()
        self._last_rows = (key, host, variant)
        return host, variant, key

    # ---- captured sampler heads
    def graph_heads(self, logits_fn: Callable[[torch.Tensor, int], torch.Tensor], max_rows: int
                    ) -> Iterator[tuple[str, Callable[[torch.Tensor, int], tuple]]]:
        """(name, fn) of every captured sampler variant (`GRAPH_HEADS`) for the graph runner to capture per
        decode bucket: fn(hidden, bucket) -> (int64 tokens `[bucket]`,), and for the logprob heads also the tokens
        with their chosen logprobs and top `GRAPH_LOGPROBS` ids and logprobs, packed (`pack_logprobs`: int32
        `[bucket, 2 + 2 * GRAPH_LOGPROBS]`),
        sampling `logits_fn(hidden, bucket)` (fp32 `[bucket, V]`) with the parameter block `stage_graph_rows`
        fills (`max_rows` rows, fixed address)."""
        if self._graph_params is None or self._graph_params.max_batch < max_rows:
            self._graph_params = SamplerParams(max_rows, self.device, max_bias=1, max_ban=1, max_penalty_tokens=1)
            self._greedy_params = SamplerParams(max_rows, self.device, max_bias=1, max_ban=1, max_penalty_tokens=1)

        def head(variant: SamplerVariant, logprobs: int, params: SamplerParams) -> Callable[[torch.Tensor, int], tuple]:
            def fn(hidden: torch.Tensor, bucket: int) -> tuple:
                out = sample(logits_fn(hidden, bucket), params, num_logprobs=max(0, logprobs), variant=variant,
                             **self._shard_args())
                if logprobs < 0:
                    return (out.tokens,)
                return out.tokens, pack_logprobs(out.tokens, out.chosen_logprob, out.top_ids, out.top_logprobs)
            return fn

        for name, (variant, logprobs) in GRAPH_HEADS.items():
            yield name, head(variant, logprobs, self._graph_params)
        yield GREEDY_LOGPROBS_HEAD, head(SamplerVariant(), GRAPH_LOGPROBS, self._greedy_params)

    @property
    def graph_params(self) -> Optional[SamplerParams]:
        """The parameter block the captured sampler heads read by address (None before `graph_heads`)."""
        return self._graph_params

    def head_params(self, head: Optional[GraphHead]) -> Optional[SamplerParams]:
        """The parameter block a step's rows are staged into for captured head `head` (an arm uploads it before
        the head): None for the greedy head (`head` None) and the greedy logprob head, which read none staged."""
        if head is None or head.name == GREEDY_LOGPROBS_HEAD:
            return None
        return self._graph_params

    def graph_head(self, batch: StepBatch, bucket: int, captured: Callable[[int, str], object]
                   ) -> Optional[tuple[GraphHead, HostBatch, tuple]]:
        """Which captured sampler head serves the sampled decode batch `batch` on a decode graph of `bucket`, the
        batch's rows for the heads' parameter block and their key (`_graph_rows`: equal keys, equal rows but for
        their positions, so `SamplerParams.stage` / `stage_armed` write only the positions of rows a mirror
        already holds): (head, rows, key), or None when the batch needs the eager sampler (more than
        `GRAPH_LOGPROBS` logprobs, logit bias, bans, penalties, an allow mask, a large top-k) or no head of that
        bucket was captured (`captured(bucket, name)` is None). A batch of greedy rows that asks for logprobs takes
        `GREEDY_LOGPROBS_HEAD`, with rows and key None (nothing to stage). Host only: nothing is staged or
        enqueued."""
        ex = batch.extras
        params = self._graph_params
        if params is None or bucket > params.max_batch or (ex is not None and (ex.num_logprobs > GRAPH_LOGPROBS
                                                                                  or ex.processed)):
            return None
        if ex is not None and ex.num_logprobs >= 0 and not (batch.temperature >= TEMPERATURE_EPS).any():
            if captured(bucket, GREEDY_LOGPROBS_HEAD) is None:
                return None
            return GraphHead(GREEDY_LOGPROBS_HEAD, ex.num_logprobs), None, None
        host, need, key = self._graph_rows(batch)
        if need.large_top_k:
            return None
        num_logprobs = -1 if ex is None else ex.num_logprobs
        name = _BY_FLAGS[(need.top_k, need.top_p, num_logprobs >= 0)]
        if captured(bucket, name) is None:
            return None
        return GraphHead(name, num_logprobs), host, key

    def stage_graph_rows(self, batch: StepBatch, bucket: int, captured: Callable[[int, str], object]
                         ) -> Optional[str]:
        """For a sampled decode batch about to replay a decode graph of `bucket`: the name of the captured sampler
        head that serves it (`graph_head`), its rows staged and uploaded (current stream) into the heads'
        parameter block; or None (nothing enqueued) when the batch needs the eager sampler. A logprob head's
        outputs hold `GRAPH_LOGPROBS` top entries: the caller keeps the batch's first N. Rows of the same key as
        the staging mirror's last ones (a decode loop's) write only their positions (`SamplerParams.stage`)."""
        found = self.graph_head(batch, bucket, captured)
        if found is None:
            return None
        params = self.head_params(found[0])
        if params is None:  # the greedy logprob head: nothing staged
            return found[0].name
        params.stage(found[1], rows_key=found[2])
        params.upload(bucket, lists=False)
        return found[0].name

    def warm_up(self, logits: torch.Tensor, threads: Optional[int] = None) -> int:
        """Launch the eager sampler once per variant class over `logits` (fp32 `[1, V]` or this rank's shard, as
        `sample` gets them; `modeling.sampler.warm_up`), so that no request compiles a kernel; launches made.
        `threads`: compile threads without TP (None: `compile_threads()`). Under TP every rank calls it together."""
        from modeling.sampler.warm_up import warm_up_sampler

        return warm_up_sampler(self.own_columns(logits), self._params_for(1), self.vocab_size, threads=threads,
                               **self._shard_args())

    def sample(self, logits: torch.Tensor, batch: StepBatch) -> tuple[torch.Tensor, Optional[tuple[torch.Tensor, int]]]:
        """logits fp32 `[n, V]` (the whole vocabulary, or under TP this rank's shard; row i = batch row i) ->
        (tokens int64 `[n]`, and when the batch asks for N logprobs (the tokens and logprobs packed by
        `pack_logprobs`, int32 `[n, 2 + 2N]`; N)), on the logits' device, not waited for."""
        n = batch.batch_size
        ex = batch.extras
        host = self._host_batch(batch)
        params = self._params_for(n)
        params.load(host, rows=n)
        num_logprobs = -1 if ex is None else ex.num_logprobs
        out = sample(self.own_columns(logits), params, num_logprobs=max(0, num_logprobs), variant=host.variant(),
                     **self._shard_args())
        if num_logprobs < 0:
            return out.tokens, None
        return out.tokens, (pack_logprobs(out.tokens, out.chosen_logprob, out.top_ids, out.top_logprobs),
                            num_logprobs)
