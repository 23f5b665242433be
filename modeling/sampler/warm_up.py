"""Start-up launches of the batched sampler, one per variant class the eager path can meet, so that no request
compiles a Triton kernel mid-serving: a compile stalls every request of its step for seconds.

The Triton kernels' compile-time constants do not depend on the batch (`triton_sampler.launch_shape`; the batch
and chunk counts are not specialised), so one row per class compiles what every batch size of that class runs.
A class is a `SamplerVariant` (processing, top-k up to `TOP_K_FAST` or larger, top-p) and a top-N class (none or
one of `LOGPROB_CLASSES`). An allow mask changes one kernel of the processed classes (the copy's `HAS_MASK`
variant), so the processed classes with a top N run masked (`warm_up_masked`) and the others without: both copies
compile, every other kernel as for each class. The captured sampler heads compile the unprocessed classes again
at capture (from the cache); prefill, mixed and uncaptured steps sample eagerly and meet all of them.

Lifetime: a rank's start-up, on the caller's current stream, before any graph is captured. One rank compiles the
classes side by side on threads (`modeling.ops.warm_up.run_side_by_side`), each with its own one-row parameter
block, so a cold Triton cache costs seconds, not a minute. Under TP every rank must call it with the same
arguments and the classes run one after another (the sampler's collectives run in lock-step).
"""
from __future__ import annotations

import functools
import itertools
from typing import Any, Optional

import numpy as np
import torch

from .allow_bits import mask_words
from .api import sample
from .collectives import ShardGroup
from .host import LOGPROB_CLASSES, TOP_K_FAST, HostBatch, RowSpec, SamplerVariant
from .params import SamplerParams


def warm_up_classes() -> list[tuple[SamplerVariant, int]]:
    """Every (variant, top-N) pair the eager sampler can launch: 2 x 3 x 2 variants x (1 + len(LOGPROB_CLASSES))."""
    variants = [SamplerVariant(processed, top_k != "off", top_p, top_k == "large")
                for processed, top_k, top_p in itertools.product((False, True), ("off", "fast", "large"),
                                                                 (False, True))]
    return [(v, n) for v in variants for n in (0, *LOGPROB_CLASSES)]


def warm_up_row(variant: SamplerVariant, vocab_size: int) -> RowSpec:
    """A sampled row that runs every stage of `variant` (ids within `vocab_size` >= 4)."""
    top_k = (TOP_K_FAST + 1 if variant.large_top_k else 20) if variant.top_k else 0
    extra: dict[str, Any] = {}
    if variant.processed:
        extra = dict(logit_bias={1: 1.0}, banned_ids=[2], presence_penalty=0.5, repetition_penalty=1.1,
                     prompt_token_ids=[3], output_token_ids=[3])
    return RowSpec(temperature=1.0, top_k=min(top_k, vocab_size - 1), top_p=0.9 if variant.top_p else 1.0, seed=1,
                   position=1, **extra)


def warm_up_masked(variant: SamplerVariant, n: int) -> bool:
    """Whether class (variant, n) warms up under an allow mask: processed classes with a top N."""
    return variant.processed and n > 0


def warm_up_mask(vocab_size: int) -> np.ndarray:
    """The allow mask of a masked warm-up row, int32 `[1, W]`: every id but 0."""
    bits = np.full((1, mask_words(vocab_size)), -1, np.int32)
    bits[0, 0] = -2
    return bits


def warm_up_sampler(logits: torch.Tensor, params: SamplerParams, vocab_size: int, *, vocab_offset: int = 0,
                    tp_group: Optional[Any] = None, shard_width: Optional[int] = None,
                    threads: Optional[int] = None) -> int:
    """Sample `logits` (`[1, V_shard]`, the dtype and layout the eager path passes) once per class of
    `warm_up_classes`, with `params` (capacity >= 1 row, lists as wide as serving loads; without TP each class
    thread takes a fresh block of the same layout instead); returns the launches. `threads`: compile threads
    (None: `compile_threads()`; 1: one after another). The outputs are dropped (the caller's stream orders their
    buffers' reuse)."""
    from modeling.ops.warm_up import prime_kernel_caches, run_side_by_side

    lay = params.layout
    caps = dict(max_bias=lay.max_bias, max_ban=lay.max_ban, max_penalty_tokens=lay.max_pen)
    classes = warm_up_classes()
    alone = ShardGroup(tp_group).size == 1

    def launch(variant: SamplerVariant, n: int) -> None:
        block = SamplerParams(1, params.device, **caps) if alone else params
        bits = warm_up_mask(vocab_size) if warm_up_masked(variant, n) else None
        block.load(HostBatch.from_rows([warm_up_row(variant, vocab_size)], vocab_size=vocab_size, **caps,
                                       allow_bits=bits), rows=1)
        sample(logits[:1], block, num_logprobs=min(n, logits.shape[1]), variant=variant, vocab_offset=vocab_offset,
               tp_group=tp_group, shard_width=shard_width)

    calls = [functools.partial(launch, variant, n) for variant, n in classes]
    if alone and logits.is_cuda:
        from . import triton_kernels, triton_select

        prime_kernel_caches([triton_kernels, triton_select], logits.device)
    run_side_by_side(calls, threads if alone else 1)
    return len(classes)
