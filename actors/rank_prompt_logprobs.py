"""A rank's prompt log-probabilities (`actors.prompt_logprobs`): from a step's hidden states, eagerly after its
forward (whichever path ran it), on the rank's forward stream.

The LM head runs on the asked rows only, a slice of rows at a time, so the fp32 logits of a long prompt never exist
at once (`SLICE_ROWS` x vocabulary floats per slice, twice with the log-softmax). Under tensor parallelism the
logits are gathered (`compute_logits`), so every TP rank of the group runs this in lock-step on the same ask, as it
runs the step.
"""
from __future__ import annotations

from typing import Callable

import torch

from actors.prompt_logprobs import PromptLogprobsAsk

SLICE_ROWS = 128


def prompt_logprobs(logits: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], hidden: torch.Tensor,
                    ask: PromptLogprobsAsk) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`logits(hidden, rows)`: the model's fp32 logits `[n, V]` of `hidden`'s rows (int64 `[n]` on its device);
    `hidden`: the step's hidden states `[T, H]`. Returns device tensors of the ask's M rows: the targets'
    log-probabilities float32 `[M]`, their ranks int32 `[M]` (1 = the most likely id), the top ids int32 `[M, K]`
    and their log-probabilities float32 `[M, K]` (K = `ask.num_top`, best first). Enqueued, not waited for."""
    dev = hidden.device
    rows = torch.tensor(ask.rows, dtype=torch.int64, device=dev)  # a copy: the ask may view a read-only buffer
    targets = torch.tensor(ask.targets, dtype=torch.int64, device=dev)
    m, k = int(rows.shape[0]), ask.num_top
    chosen = torch.empty(m, dtype=torch.float32, device=dev)
    ranks = torch.empty(m, dtype=torch.int32, device=dev)
    top_ids = torch.empty((m, k), dtype=torch.int32, device=dev)
    top_lps = torch.empty((m, k), dtype=torch.float32, device=dev)
    for s in range(0, m, SLICE_ROWS):
        e = min(m, s + SLICE_ROWS)
        lp = torch.log_softmax(logits(hidden, rows[s:e]).float(), dim=-1)
        c = lp.gather(1, targets[s:e, None])
        chosen[s:e] = c[:, 0]
        ranks[s:e] = (lp > c).sum(dim=-1, dtype=torch.int32) + 1
        if k:
            vals, ids = lp.topk(k, dim=-1)
            top_ids[s:e], top_lps[s:e] = ids.to(torch.int32), vals
    return chosen, ranks, top_ids, top_lps
