"""The decode graph's static buffers: a host decode step written straight into the staging mirror fills
exactly what the field-by-field copy of the same step's tensors fills (CPU buffers, same code path as the
pinned mirror of a CUDA rank apart from the transfer's device)."""
import numpy as np
import pytest
import torch

from graphrunner.staging import staging_for
from graphrunner.step import ForwardStep, GraphMeta
from modeling.attn_metadata import HostDecodeMetadata, build_decode_step_host, build_step_from_arrays
from modeling.config import get_preset
from modeling.qwen3 import Qwen3ForCausalLM
from tests.unit._decode_rows import random_decode_rows

BS = 4
FIELDS = ("input_ids", "position_ids", "slot_mapping", "kv_seqlens", "block_tables")


@pytest.fixture(scope="module")
def model():
    return Qwen3ForCausalLM(get_preset("qwen3-tiny"))


def _batch(rng, n, width):
    return random_decode_rows(rng, n, width, BS)


def _buffers(model, meta):
    return model.make_buffers(meta, staging_for(model, meta))


def _fill(model, buffers, step, p):
    model.fill_buffers(buffers, step, p)
    return {f: buffers[f][:p].clone() for f in FIELDS}


@pytest.mark.parametrize("n,p,width", [(1, 1, 3), (1, 4, 5), (3, 4, 2), (5, 8, 8), (8, 8, 1)])
def test_host_fill_equals_tensor_fill(model, n, p, width):
    rng = np.random.default_rng(n * 100 + p * 10 + width)
    meta = GraphMeta(max_batch_size=8, max_tokens=8, max_blocks_per_seq=8, device=torch.device("cpu"))
    host_bufs, dev_bufs = _buffers(model, meta), _buffers(model, meta)
    for _ in range(3):  # successive steps: stale rows of a wider/larger earlier step must not survive
        ids, hist, tables = _batch(rng, n, width)
        ids_h, pos_h, hmeta = build_decode_step_host(ids, hist, tables, BS)
        assert isinstance(hmeta, HostDecodeMetadata) and hmeta.batch_size == n and hmeta.num_tokens == n
        got = _fill(model, host_bufs, ForwardStep(ids_h, pos_h, [], hmeta), p)
        ids_t, pos_t, tmeta = build_step_from_arrays(ids, np.ones(n, np.int32), hist, tables, BS, "cpu")
        want = _fill(model, dev_bufs, ForwardStep(ids_t, pos_t, [], tmeta), p)
        for f in FIELDS:
            assert torch.equal(got[f], want[f]), f
        assert (got["slot_mapping"][:n] >= 0).all() and (got["slot_mapping"][n:] == -1).all()
        width = int(rng.integers(1, 9))


def test_host_fill_after_a_wider_step_clears_old_table_columns(model):
    meta = GraphMeta(max_batch_size=4, max_tokens=4, max_blocks_per_seq=6, device=torch.device("cpu"))
    bufs = _buffers(model, meta)
    wide = np.arange(1, 7, dtype=np.int32)[None, :]
    ids, pos, hmeta = build_decode_step_host(np.array([3]), np.array([21], np.int32), wide, BS)
    model.fill_buffers(bufs, ForwardStep(ids, pos, [], hmeta), 1)
    narrow = np.array([[9, 10]], np.int32)
    ids, pos, hmeta = build_decode_step_host(np.array([4]), np.array([5], np.int32), narrow, BS)
    model.fill_buffers(bufs, ForwardStep(ids, pos, [], hmeta), 1)
    assert bufs["block_tables"][0].tolist() == [9, 10, 0, 0, 0, 0]
    assert bufs["slot_mapping"][0].item() == 10 * BS + 1 and bufs["kv_seqlens"][0].item() == 6
    assert bufs["position_ids"][0].item() == 5 and bufs["input_ids"][0].item() == 4


def test_armed_staging_pads_then_stages_the_live_step(model):
    """An armed replay's staging (`FullGraphRunner.arm` / `stage_armed`, through the `HostStaging`): padding
    rows over a previous step's rows, then the live step's host arrays written before the transfer, equal the
    ordinary host fill."""
    rng = np.random.default_rng(7)
    meta = GraphMeta(max_batch_size=8, max_tokens=8, max_blocks_per_seq=8, device=torch.device("cpu"))
    bufs, ref = _buffers(model, meta), _buffers(model, meta)
    staging = bufs["staging"]
    ids, hist, tables = _batch(rng, 5, 6)
    ids_h, pos_h, hmeta = build_decode_step_host(ids, hist, tables, BS)
    _fill(model, bufs, ForwardStep(ids_h, pos_h, [], hmeta), 8)
    staging.wait()
    staging.pad_rows(0, 8)
    staging.copy_prefix(8)
    pad = {f: bufs[f][:8].clone() for f in FIELDS}
    assert (pad["input_ids"] == 0).all() and (pad["position_ids"] == 0).all() and (pad["block_tables"] == 0).all()
    assert (pad["slot_mapping"] == -1).all() and (pad["kv_seqlens"] == 1).all()  # writes no KV
    ids, hist, tables = _batch(rng, 3, 4)
    staging.stage_decode(ids, hist, tables, BS, 4)
    staging.copy_prefix(4)
    ids_h, pos_h, hmeta = build_decode_step_host(ids, hist, tables, BS)
    want = _fill(model, ref, ForwardStep(ids_h, pos_h, [], hmeta), 4)
    for f in FIELDS:
        assert torch.equal(bufs[f][:4], want[f]), f


def test_update_context_views_the_buffers(model):
    meta = GraphMeta(max_batch_size=4, max_tokens=4, max_blocks_per_seq=3, device=torch.device("cpu"))
    bufs = _buffers(model, meta)
    ids, pos, hmeta = build_decode_step_host(np.array([1, 2]), np.array([0, 4], np.int32),
                                             np.array([[1, 0], [2, 3]], np.int32), BS)
    step = ForwardStep(ids, pos, [], hmeta, batch_bucket_hint=4)
    a, b = model.update_context(bufs, step, 4), model.update_context(bufs, step, 4)
    assert a is not step and a.batch_bucket_hint == 4 and step.input_ids is ids  # the live step is untouched
    assert a.input_ids.data_ptr() == bufs["input_ids"].data_ptr() and a.input_ids.shape == (4,)
    assert a.attn_metadata.block_tables.shape == (4, 3) and a.attn_metadata.max_kv_seqlen == 3 * BS
    assert a.attn_metadata is b.attn_metadata  # made once per bucket
