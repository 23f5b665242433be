"""`StepSampler`: one rank's sampling of a step's rows that do not take the greedy head (a temperature above 0,
or sampler extras: min_p, penalties, logit bias, banned ids, logprobs), with the batched sampler of
`modeling.sampler` (Triton kernels on CUDA, the torch path on CPU): counter-based noise keyed by (seed, position),
no host loop, no per-row generator, no host sync.

Lifetime: the rank's. The device parameter block (`SamplerParams`) is allocated for `capacity` rows and grown
(a new block) when a larger batch arrives; its list section is sized by the deployment's limits. Stream: the
caller's current stream (the rank's forward stream): the parameters are copied and the kernels launched there.
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from actors.batch import StepBatch
from modeling.sampler import SamplerParams, sample
from modeling.sampler.host import host_batch_from_arrays

MAX_BIAS = 300  # = engine.sampling_params.LOGIT_BIAS_MAX_ENTRIES
MAX_BAN = 1040  # stop token ids (at most 1024) and EOS ids, banned while a request is below min_tokens


class StepSampler:
    def __init__(self, device: torch.device, vocab_size: int, max_model_len: int, capacity: int = 64):
        self.device, self.vocab_size = device, vocab_size
        self.max_penalty_tokens = max(1, max_model_len)
        self._params: Optional[SamplerParams] = None
        self._capacity = capacity

    def _params_for(self, n: int) -> SamplerParams:
        if self._params is None or self._params.max_batch < n:
            while self._capacity < n:
                self._capacity *= 2
            self._params = SamplerParams(self._capacity, self.device, max_bias=MAX_BIAS, max_ban=MAX_BAN,
                                         max_penalty_tokens=self.max_penalty_tokens)
        return self._params

    def sample(self, logits: torch.Tensor, batch: StepBatch
               ) -> tuple[torch.Tensor, Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]]:
        """logits fp32 `[n, V]` (the whole vocabulary, row i = batch row i) -> (tokens int64 `[n]`, and when the
        batch asks for logprobs (chosen fp32 `[n]`, top ids int64 `[n, N]`, top logprobs fp32 `[n, N]`)), on the
        logits' device, not waited for."""
        n = batch.batch_size
        ex = batch.extras
        position = batch.num_history.astype(np.int64) + batch.q_seqlens
        kw = {} if ex is None else dict(min_p=ex.min_p, penalties=ex.penalties, bias_ids=ex.bias_ids,
                                        bias_vals=ex.bias_vals, ban_ids=ex.ban_ids, pen_ids=ex.pen_ids,
                                        pen_counts=ex.pen_counts)
        host = host_batch_from_arrays(batch.temperature, batch.top_k, batch.top_p, batch.seeds, position,
                                      vocab_size=self.vocab_size, **kw)
        params = self._params_for(n)
        params.load(host, rows=n)
        num_logprobs = -1 if ex is None else ex.num_logprobs
        out = sample(logits, params, num_logprobs=max(0, num_logprobs), variant=host.variant())
        if num_logprobs < 0:
            return out.tokens, None
        return out.tokens, (out.chosen_logprob, out.top_ids, out.top_logprobs)
