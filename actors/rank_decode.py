"""`RankDecodeSteps`: the step-building half of `actors.rank.RankRuntime`, a mixin over its state (model, KV
cache, graph runner, sampler, decode lanes): one step's tokens on the general path (eager or piecewise forward,
eager LM head, the eager sampler), a chunked-prefill step split into its decode and prefill halves
(`actors.mixed_split`), the decode fast path (host metadata, one staging copy, decode graph replay,
an LM-head epilogue: greedy, logits or a captured sampler head), and multi-step decode (greedy on the device;
sampled one step at a time, each draw keyed by its own position). Every call enqueues on the rank's forward
stream and returns device tensors, not waited for. In: the batch, its token ids (host, and on the device when they
refer to the previous step's tokens) and the coordinator's `StepHints`, which every `ForwardStep` carries."""
from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np
import torch

from actors.batch import StepBatch
from actors.decode_state import GREEDY_HEAD, LOGITS_HEAD, _DecodeLane, forward_step
from actors.mixed_split import split_rows, splittable
from actors.protocol import StepHints
from actors.rank_prompt_logprobs import prompt_logprobs
from actors.step_sampler import GraphHead, StepSampler, VocabShard
from graphrunner.dispatch import Path as RunnerPath
from graphrunner.step import ForwardStep
from modeling.attn_metadata import (AttentionMetadata, build_decode_step_host, build_prefill_step_host,
                                    build_step_from_arrays)


class RankDecodeSteps:
    def _step_tokens(self, batch: StepBatch, ids: np.ndarray, ids_dev: Optional[torch.Tensor],
                     hints: StepHints) -> torch.Tensor:
        """Enqueue one step; its next tokens, int64 `[B]` on the rank's device (not waited for). A step that asks for
        prompt log-probabilities takes the general path (they need the hidden states of every asked row)."""
        if self.device.type == "cuda" and batch.prompt_lp is None:
            decoding = batch.num_tokens == batch.batch_size
            if not decoding:
                out = self._mixed_split(batch, ids, ids_dev, hints)
                if out is not None:
                    return out
            if decoding or ids_dev is None:
                out = (self._decode_fast if decoding else self._prefill_fast)(batch, ids, ids_dev, hints)
                if out is not None:
                    return out
        return self._general_step(batch, ids, ids_dev, hints)

    def _mixed_split(self, batch: StepBatch, ids: np.ndarray, ids_dev: Optional[torch.Tensor],
                     hints: StepHints) -> Optional[torch.Tensor]:
        """A chunked-prefill step as its decode rows' decode step then its prefill rows' step (`actors.mixed_split`),
        when the decode rows get a full decode graph and the prefill rows' token ids are on the host; their
        tokens in row order, int64 `[B]`. None (nothing launched) when the step runs whole."""
        n = splittable(batch, self.logits_observer is not None, hints.global_decode is None,
                       self.cfg.split_mixed_steps)
        if n is None or (ids_dev is not None and int(batch.token_ids[n:].min()) < 0):
            return None
        head, tail = split_rows(batch, n)
        first = self._decode_fast(head, ids[:n], None if ids_dev is None else ids_dev[:n], hints)
        if first is None:  # no decode graph for the rows: nothing launched
            return None
        self._last_lane, self._last_host_ids, self._last_head = None, False, None  # no arm after a mixed step
        rest = self._prefill_fast(tail, ids[n:], None, hints)
        if rest is None:
            rest = self._general_step(tail, ids[n:], None, hints)
        return torch.cat([first, rest])

    def _general_step(self, batch: StepBatch, ids: np.ndarray, ids_dev: Optional[torch.Tensor],
                      hints: StepHints) -> torch.Tensor:
        """Any step on the runner's dispatch (piecewise plans, eager), the eager LM head and sampler."""
        ids_t, pos, meta = build_step_from_arrays(ids, batch.q_seqlens, batch.num_history, batch.block_tables,
                                                  self.cfg.block_size, self.device)
        step = forward_step(ids_t if ids_dev is None else ids_dev, pos, self.kv_cache.layers, meta, hints)
        hidden = self.runner(step)
        if batch.prompt_lp is not None:
            self._step_prompt = prompt_logprobs(self.model.compute_logits, hidden, batch.prompt_lp)
        sampled = bool(batch.temperature.any()) or batch.extras is not None
        logits, greedy = self._eager_head(hidden, meta.last_token_index, sampled)
        return self._sample(logits, batch) if sampled else greedy

    def _eager_head(self, hidden: torch.Tensor, rows: torch.Tensor, need_logits: bool
                    ) -> tuple[Optional[torch.Tensor], torch.Tensor]:
        """The LM head without a graph: (fp32 logits `[n, V]` when `need_logits` (the caller samples) or a logits
        observer is set, else None; int64 greedy tokens `[n]`, None when `need_logits`). Calls the observer. Under
        TP with no observer the logits are this rank's vocabulary shard `[n, V / tp]` (nothing gathered)."""
        if not need_logits and self.logits_observer is None:
            return None, self.model.greedy_tokens(hidden, rows)
        if self.logits_observer is None and self.ctx.tp_size > 1:  # the sampler takes this rank's shard
            return self.model.compute_logits_shard(hidden, rows), None
        logits = self.model.compute_logits(hidden, rows)
        if self.logits_observer is not None:
            self.logits_observer(logits)
        return logits, None if need_logits else logits.argmax(dim=-1)

    def _decode_fast(self, batch: StepBatch, ids: np.ndarray, ids_dev: Optional[torch.Tensor],
                     hints: StepHints) -> Optional[torch.Tensor]:
        """A decode step served by a captured graph: host-side metadata, one host-to-device copy (plus a
        device copy of previous-step token ids), graph replay, then the LM-head graph of the bucket. None when
        the step would not replay a full graph (the caller then takes the general path; nothing was launched)."""
        ids_h, pos, meta = build_decode_step_host(ids, batch.num_history, batch.block_tables, self.cfg.block_size)
        step = forward_step(ids_h if ids_dev is None else ids_dev, pos, self.kv_cache.layers, meta, hints)
        sampled = bool(batch.temperature.any()) or batch.extras is not None
        self._last_head = None
        launched = self._decode_graph_step(step, sampled_batch=batch if sampled else None)
        if launched is None:
            return None
        logits, tokens = launched
        if self.logits_observer is None and (not sampled or self._last_head is not None):
            self._add_lane(step, hints, reuse=sampled)  # a sampled step may arm with its sampler head
            self._last_host_ids = ids_dev is None
        return self._sample(logits, batch) if logits is not None and sampled else tokens

    def _prefill_fast(self, batch: StepBatch, ids: np.ndarray, ids_dev: None, hints: StepHints
                      ) -> Optional[torch.Tensor]:
        """A prefill or mixed step (token ids on the host) served by a captured full prefill graph: its metadata
        goes from the host into the graph's buffers in one transfer (`HostPrefillMetadata`), then the replay and
        the eager LM head on the last tokens. None when no prefill graph serves it (nothing was launched)."""
        ids_h, meta = build_prefill_step_host(ids, batch.q_seqlens, batch.num_history, batch.block_tables,
                                              self.cfg.block_size)
        step = forward_step(ids_h, ids_h, self.kv_cache.layers, meta, hints)
        decision = self.runner.decide(step)
        if decision.path is not RunnerPath.PREFILL_GRAPH:
            return None
        hidden = self.runner.run(step, decision)
        sampled = bool(batch.temperature.any()) or batch.extras is not None
        logits, greedy = self._eager_head(hidden, meta.last_token_index, sampled)
        return self._sample(logits, batch) if sampled else greedy

    def _add_lane(self, step: ForwardStep, hints: StepHints, reuse: bool = False) -> None:
        """Remember the graphs that served this decode step (greedy, or sampled by a captured sampler head: the
        decode graph is the same), so the next greedy step of the same shape and hints skips the dispatch and
        an arm knows the graph (`_DecodeLane`). `reuse`: keep a lane already known for that shape. Forgotten
        whenever graphs are captured or dropped."""
        n = step.batch_size
        if reuse and (lane := self._lanes.get((n, n, hints))) is not None:
            self._last_lane = lane
            return
        decision = self.runner.decide_decode(step)  # pure: the decision the step just replayed
        if decision.path is not RunnerPath.FULL_GRAPH:
            return
        head = self.runner.epilogue_outputs(decision.decode_key.batch, GREEDY_HEAD)
        if head is None:
            return
        lane = self._lanes[(n, n, hints)] = _DecodeLane(decision.decode_key, head[0], step, hints,
                                                        self.cfg.block_size)
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
                    outs = run_head(bucket, name)
                    k = -1
                    if len(outs) > 1:  # a logprob head (packed): the batch keeps N of its GRAPH_LOGPROBS entries
                        k = sampled_batch.extras.num_logprobs
                        self._step_logprobs = (outs[1][:n], k)
                    self._last_head = GraphHead(name, k)  # what an arm after this step replays (`actors.armed`)
                    return None, outs[0][:n]
        sharded_head = self.ctx.tp_size > 1  # under TP the logits head yields this rank's shard only
        outs = None if sharded_head and self.logits_observer is not None else run_head(bucket, LOGITS_HEAD)
        if outs is None:
            logits, greedy = self._eager_head(hidden, self._decode_rows(n), sampled_batch is not None)
            return logits, greedy
        logits = outs[0][:n]
        if self.logits_observer is not None:
            self.logits_observer(logits)
        return logits, outs[1][:n]

    def _multi_step_tokens(self, batch: StepBatch, ids: np.ndarray, ids_dev: Optional[torch.Tensor],
                           hints: StepHints, num_steps: int) -> torch.Tensor:
        """Enqueue `num_steps` greedy decode steps; their tokens, int64 `[num_steps, B]` on the device."""
        sampled = bool(batch.temperature.any())
        if self.device.type == "cuda" and not sampled:
            out = self._decode_multi_on_device(batch, ids, ids_dev, hints, num_steps)
            if out is not None:
                return out
        # general path: one step at a time, each step's tokens feeding the next on the device
        rows = []
        for _ in range(num_steps):
            toks = self._step_tokens(batch, ids, ids_dev, hints)
            rows.append(toks)
            ids_dev = toks
            batch = dataclasses.replace(batch, num_history=(batch.num_history + 1).astype(np.int32))
        return torch.stack(rows)

    def _decode_multi_on_device(self, batch: StepBatch, ids: np.ndarray, ids_dev: Optional[torch.Tensor],
                                hints: StepHints, num_steps: int) -> Optional[torch.Tensor]:
        """Multi-step greedy decode on captured graphs: each step's tokens stay on the device and feed the next
        step's graph; positions, slots and lengths of every step are computed on the host up front and copied
        once. Returns int64 `[num_steps, B]` on the device (not waited for), or None: no graph fits."""
        bs, n = self.cfg.block_size, batch.batch_size
        ids_h, pos, meta = build_decode_step_host(ids, batch.num_history, batch.block_tables, bs)
        first = self._decode_graph_step(forward_step(ids_h if ids_dev is None else ids_dev, pos,
                                                     self.kv_cache.layers, meta, hints))
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
            launched = self._decode_graph_step(forward_step(tokens[j - 1], pos_d[j - 1], self.kv_cache.layers,
                                                            step_meta, hints))
            if launched is None:  # cannot happen for a batch whose first step replayed a graph
                raise RuntimeError("multi-step decode lost its decode graph mid-way")
            tokens[j].copy_(launched[1])
        return tokens

    def sampler(self) -> StepSampler:
        """This rank's batched sampler (`actors.step_sampler`), made at first use."""
        if self._sampler is None:
            shard = None
            if self.ctx.tp_size > 1:
                shard = VocabShard(*self.model.logits_shard(), self.ctx.tp_group)
            self._sampler = StepSampler(self.device, self.model_config.vocab_size, self.cfg.max_model_len,
                                        shard=shard)
        return self._sampler

    def warm_up_sampler(self) -> int:
        """The eager sampler's compiles at start-up (`StepSampler.warm_up`), over logits of the shape and layout
        `_eager_head` gives a sampled step; launches made. CUDA ranks, on the current stream, in lock-step under TP."""
        hidden = torch.zeros((1, self.model_config.hidden_size), dtype=self.model_config.dtype, device=self.device)
        rows = torch.zeros((1,), dtype=torch.int64, device=self.device)
        head = self.model.compute_logits_shard if self.ctx.tp_size > 1 else self.model.compute_logits
        return self.sampler().warm_up(head(hidden, rows), threads=self.cfg.kernels.compile_threads)

    def _sample(self, logits: torch.Tensor, batch: StepBatch) -> torch.Tensor:
        """The eager batched sampler over fp32 logits `[n, V]`; the step's logprobs, when its batch asks for them,
        wait in `_step_logprobs` for the read-back."""
        tokens, self._step_logprobs = self.sampler().sample(logits, batch)
        return tokens
