"""Loading a checkpoint into a CUDA model (inside `with torch.device("cuda")`, as a rank does) allocates no device
memory beyond the parameters plus one slice: tensors are read on the host, only this rank's part is copied up.

GPU only (marker `gpu`); uses the random-weight checkpoint writer, so it needs no transformers.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from modeling.config import get_preset
from modeling.loader import load_checkpoint, save_checkpoint
from modeling.qwen3 import Qwen3ForCausalLM
from parallel.context import ParallelContext

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("ctx", [ParallelContext(), ParallelContext(tp_rank=1, tp_size=2)], ids=["tp1", "tp2r1"])
def test_cuda_load_peak_is_params_plus_one_slice(tmp_path, ctx):
    cfg = dataclasses.replace(get_preset("qwen3-tiny"), hidden_size=512, intermediate_size=2048, vocab_size=4096,
                              head_dim=128)
    save_checkpoint(cfg, tmp_path, seed=1, shards=3)
    ref = Qwen3ForCausalLM(cfg, ctx)
    load_checkpoint(ref, tmp_path)
    with torch.device("cuda"):
        model = Qwen3ForCausalLM(cfg, ctx, "cuda")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    with torch.device("cuda"):
        load_checkpoint(model, tmp_path)
    torch.cuda.synchronize()
    largest_param = max(p.numel() * p.element_size() for p in model.parameters())
    assert torch.cuda.max_memory_allocated() - before <= largest_param, "a full tensor was materialised on the GPU"
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p.cpu(), q, rtol=0, atol=0, msg=name)
