"""Long prefill sequences through cuDNN (`modeling.ops.sdpa_prefill`) on the GPU: the by-sequence split equals the
torch reference of the paged prefill for fresh prompts, chunks after history and mixed steps, with the cuDNN and
flash backends and GQA groups up to 8; the Triton ops bind it by default and not with `prefill_sdpa=False`; a model's
long prompt's last chunk (29M attended pairs) leaves the full prefill graph for the piecewise plans with the option on
and gives the same last-token logits either way, closely."""
from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

from modeling.ops import attention_ref as ref
from modeling.ops.options import KernelOptions
from tests.gpu.test_triton_kernels import PagedBatch, tri

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(tri is None, reason="triton is not installed")]

CASES = {
    "fresh": [(700, 0), (257, 0)],
    "chunk_after_history": [(600, 300), (2048, 6144)],
    "mixed": [(1, 99), (512, 0), (40, 10), (1, 8191), (300, 700), (3, 5)],
}


@pytest.mark.parametrize("backend", ["cudnn", "flash"])
@pytest.mark.parametrize("group", [2, 8])
@pytest.mark.parametrize("kind", sorted(CASES))
@torch.inference_mode()
def test_by_sequence_equals_the_paged_reference(kind, group, backend):
    from modeling.ops.sdpa_prefill import prefill_attention_by_sequence

    d, hkv, pad = 128, 4, 5
    batch = PagedBatch(CASES[kind], hkv, d, 64, torch.bfloat16, seed=group)
    m = batch.m
    q = torch.randn(m.num_tokens + pad, hkv * group, d, device="cuda").bfloat16()
    args = (q, batch.k_cache, batch.v_cache, m.q_start_loc, m.q_seqlens, m.kv_seqlens, m.block_tables, d ** -0.5)
    out = prefill_attention_by_sequence(*args, host=m.host_lens, fallback=tri.prefill_attention,
                                        max_q_seqlen=m.max_q_seqlen, backend=backend, min_pairs=100_000)
    expected = ref.prefill_attention(*args)
    torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=2e-2)
    assert torch.count_nonzero(out[m.num_tokens:]) == 0


def test_triton_ops_bind_it_by_default_only():
    from modeling.ops import get_kernel_ops

    assert get_kernel_ops("cuda").prefill_by_sequence is not None
    assert get_kernel_ops("cuda", options=KernelOptions(prefill_sdpa=False)).prefill_by_sequence is None


@torch.inference_mode()
def test_long_prompt_chunk_takes_cudnn_in_the_piecewise_plans_and_matches_the_prefill_graph():
    from graphrunner.dispatch import Path
    from tests.gpu.helpers import Seqs, make_runtime, random_tokens

    rng = np.random.default_rng(7)
    prompt = random_tokens(rng, 14336, 150000)  # 4096 x 3, then 2048 after 12288: 29.3M pairs, over SDPA_MIN_PAIRS
    last, paths = {}, {}
    for on in (True, False):
        rt = make_runtime("qwen3-0.6b", blocks=240, max_len=14336, kernels=KernelOptions(prefill_sdpa=on),
                          max_decode_batch=4, pcg_max_tokens=4096, prefill_graph_max_tokens=2048)
        seqs = Seqs(rt)
        table = seqs.new(len(prompt))
        for hist in (0, 4096, 8192, 12288):
            step = seqs.step([prompt[hist:hist + 4096]], [hist], [table])
            decision = rt.runner.decide(step)
            hidden = rt.runner.run(step, decision)
        paths[on] = decision.path
        last[on] = rt.model.compute_logits(hidden, step.attn_metadata.last_token_index).float()
        del rt
        gc.collect()
        torch.cuda.empty_cache()
    assert paths == {True: Path.PIECEWISE, False: Path.PREFILL_GRAPH}
    a, b = last[True], last[False]
    assert not torch.equal(a, b)  # a different attention ran
    cos = torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0).item()
    assert cos > 0.999, cos
