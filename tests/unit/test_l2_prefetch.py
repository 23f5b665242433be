"""The L2 prefetch of a decode layer's next weights (`modeling/ops/triton_prefetch.py`, `KernelOptions.l2_prefetch_mb`):
its plan (the weights in order, whole 128-byte lines, up to the budget) and where the model calls it (once per layer
between the qkv projection and the attention, on decode steps only, in both layouts, with the weights the layer
reads after its attention in that order). The kernel itself is CUDA-only (inline PTX): tests/gpu/test_l2_prefetch_gpu.py."""
import dataclasses

import pytest
import torch

from modeling.attn_metadata import SequenceSlice, build_step
from modeling.config import get_preset
from modeling.kv_cache import KVCacheSpec, PagedKVCache
from modeling.loader import init_random
from modeling.ops import get_kernel_ops
from modeling.qwen3 import Qwen3DecoderLayer, Qwen3ForCausalLM

pytest.importorskip("triton", reason="triton_prefetch is a Triton module")
from modeling.ops.triton_prefetch import LINE, MAX_TENSORS, prefetch_plan  # noqa: E402


def test_the_plan_takes_whole_lines_in_order_up_to_the_budget():
    a = torch.zeros(64, 64, dtype=torch.bfloat16)  # 8192 bytes = 64 lines
    b = torch.zeros(1000, dtype=torch.float32)  # 4000 bytes = 31.25 lines
    c = torch.zeros(10, dtype=torch.bfloat16)
    plan = prefetch_plan([a, b, c], 8192 + 2000)
    assert [lines for _, lines in plan] == [64, 2000 // LINE, 0]
    assert plan[0][0].dtype == torch.uint8 and plan[0][0].data_ptr() == a.data_ptr() and plan[0][0].numel() == 8192
    assert [lines for _, lines in prefetch_plan([a, b], 1 << 30)] == [64, 4000 // LINE]  # the tail line is dropped
    assert [lines for _, lines in prefetch_plan([a, b], 0)] == [0, 0]
    assert len(prefetch_plan([a, b, c, a], 1 << 30)) == MAX_TENSORS
    with pytest.raises(ValueError, match="contiguous"):
        prefetch_plan([a.t()], 1 << 20)


@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("preset", ["qwen3-tiny", "qwen3-moe-tiny"])
def test_the_model_prefetches_each_layers_next_weights_on_decode_steps_only(preset, norm_first):
    torch.set_num_threads(2)
    calls: list[tuple[int, ...]] = []
    ops = get_kernel_ops("cpu")
    assert ops.l2_prefetch is None  # the torch backend has none
    ops = dataclasses.replace(ops, l2_prefetch=lambda weights: calls.append(tuple(id(w) for w in weights)))
    if norm_first:
        ops = dataclasses.replace(ops, prologue_norm_max_tokens=1 << 20)
    model = Qwen3ForCausalLM(get_preset(preset), ops=ops)
    init_random(model, seed=3)
    cache = PagedKVCache(KVCacheSpec.for_model(model.config, 16, block_size=4), "cpu")
    table = list(range(1, 6))
    with torch.no_grad():
        ids, pos, meta = build_step([SequenceSlice([3, 17, 250, 9, 41], 0, table)], 4, "cpu")
        model(ids, pos, cache.layers, meta)
        assert calls == []  # a prefill step prefetches nothing
        for step in range(3):
            ids, pos, meta = build_step([SequenceSlice([7], 5 + step, table)], 4, "cpu")
            model(ids, pos, cache.layers, meta)
    layers: list[Qwen3DecoderLayer] = list(model.layers)
    want = [tuple(id(w) for w in layer.weights_after_attention()) for layer in layers]
    assert calls == want * 3
    first = layers[0]
    if preset == "qwen3-tiny":
        assert first.weights_after_attention() == (first.self_attn.o_proj.weight, first.mlp.gate_up_proj.weight,
                                                   first.mlp.down_proj.weight)
    else:
        assert first.weights_after_attention() == (first.self_attn.o_proj.weight, first.mlp.gate.weight)
