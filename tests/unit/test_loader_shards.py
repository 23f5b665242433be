"""Loading real-format checkpoints: multi-shard with an index equals one file; index faults name the file or the
tensor; a TP / EP rank reads only its slices and experts (recorded at the checkpoint's lazy tensors, the real
reader underneath); fused expert tensors; reads stay on the host under a `torch.device` context."""
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

pytest.importorskip("transformers")

from modeling.checkpoint_files import INDEX_FILE, iter_checkpoint
from modeling.config import load_config
from modeling.loader import CheckpointError, load_checkpoint, load_tensors
from modeling.qwen3 import Qwen3ForCausalLM
from parallel.context import ParallelContext
from tests.fixtures.hf_checkpoints import build_checkpoint


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("dense1"), seed=7)


@pytest.fixture(scope="module")
def dense_sharded(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("dense3"), seed=7, shards=3)


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("moe"), moe=True, seed=5)


def _load(ckpt, ctx=None) -> Qwen3ForCausalLM:
    m = Qwen3ForCausalLM(load_config(ckpt), ctx)
    load_checkpoint(m, ckpt)
    return m


def _params(m) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in m.named_parameters()}


class Recording:
    """Forwards to a real lazy checkpoint tensor and records how many elements each read returned."""

    def __init__(self, inner, log: dict[str, int]):
        self.inner, self.log = inner, log
        self.shape = inner.shape

    def __getitem__(self, key):
        out = self.inner[key]
        self.log[self.inner.name] = self.log.get(self.inner.name, 0) + out.numel()
        return out

    def view(self, key):
        return Recording(self.inner.view(key), self.log)


def _load_recorded(ckpt, ctx) -> tuple[Qwen3ForCausalLM, dict[str, int], dict[str, int]]:
    m = Qwen3ForCausalLM(load_config(ckpt), ctx)
    reads: dict[str, int] = {}
    sizes: dict[str, int] = {}

    def items():
        for name, t in iter_checkpoint(ckpt):
            sizes[name] = t.nbytes // t.dtype.itemsize
            yield name, Recording(t, reads)

    with torch.no_grad():
        load_tensors(m, items())
    return m, reads, sizes


def test_multi_shard_loads_the_same_weights_as_one_file(dense, dense_sharded):
    files = json.loads((dense_sharded / INDEX_FILE).read_text())["weight_map"].values()
    assert len(set(files)) >= 3
    one = load_file(str(dense / "model.safetensors"))
    many = {}
    for f in set(files):
        many.update(load_file(str(dense_sharded / f)))
    assert one.keys() == many.keys() and all(torch.equal(one[k], many[k]) for k in one)  # same seed, same weights
    a, b = _params(_load(dense)), _params(_load(dense_sharded))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst, json.loads((dst / INDEX_FILE).read_text())


def _write_index(d, index):
    (d / INDEX_FILE).write_text(json.dumps(index))


def test_index_names_the_missing_file(dense_sharded, tmp_path):
    d, index = _copy(dense_sharded, tmp_path / "c")
    victim = sorted(set(index["weight_map"].values()))[1]
    (d / victim).unlink()
    with pytest.raises(CheckpointError, match=f"missing shard file.*{victim}"):
        load_checkpoint(Qwen3ForCausalLM(load_config(d)), d)


def test_index_pointing_at_an_absent_file_names_it(dense_sharded, tmp_path):
    d, index = _copy(dense_sharded, tmp_path / "c")
    index["weight_map"]["model.norm.weight"] = "model-00009-of-00009.safetensors"
    _write_index(d, index)
    with pytest.raises(CheckpointError, match="model-00009-of-00009.safetensors"):
        load_checkpoint(Qwen3ForCausalLM(load_config(d)), d)


def test_index_listing_an_absent_tensor_names_it(dense_sharded, tmp_path):
    d, index = _copy(dense_sharded, tmp_path / "c")
    first = sorted(set(index["weight_map"].values()))[0]
    index["weight_map"]["model.layers.0.mlp.gate_proj.weight_scale"] = first
    _write_index(d, index)
    with pytest.raises(CheckpointError, match=f"lists tensor model.layers.0.mlp.gate_proj.weight_scale in {first}"):
        load_checkpoint(Qwen3ForCausalLM(load_config(d)), d)


def test_tensor_missing_from_the_index_is_named(dense_sharded, tmp_path):
    d, index = _copy(dense_sharded, tmp_path / "c")
    fname = index["weight_map"].pop("model.layers.1.self_attn.k_norm.weight")
    _write_index(d, index)
    with pytest.raises(CheckpointError, match=f"{fname} holds tensor model.layers.1.self_attn.k_norm.weight"):
        load_checkpoint(Qwen3ForCausalLM(load_config(d)), d)


@pytest.mark.parametrize("text, message", [("{oops", "not valid JSON"), ('{"metadata": {}}', "'weight_map'"),
                                           ('{"weight_map": {"a": "../x.safetensors"}}', "not a file name")])
def test_malformed_index(dense_sharded, tmp_path, text, message):
    d, _ = _copy(dense_sharded, tmp_path / "c")
    (d / INDEX_FILE).write_text(text)
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(Qwen3ForCausalLM(load_config(d)), d)


def test_only_the_files_the_index_names_are_read(dense_sharded, tmp_path):
    d, index = _copy(dense_sharded, tmp_path / "c")
    shutil.copy(d / sorted(set(index["weight_map"].values()))[0], d / "consolidated.safetensors")
    ref = _params(_load(dense_sharded))
    got = _params(_load(d))
    assert all(torch.equal(ref[k], got[k]) for k in ref)
    (d / INDEX_FILE).unlink()  # without an index every file is read: the copy's tensors now appear twice
    with pytest.raises(CheckpointError, match="appears in both"):
        load_checkpoint(Qwen3ForCausalLM(load_config(d)), d)


def test_corrupt_file_is_named(dense, tmp_path):
    d = shutil.copytree(dense, tmp_path / "c")
    (d / "model.safetensors").write_bytes((d / "model.safetensors").read_bytes()[:100])
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_checkpoint(Qwen3ForCausalLM(load_config(d)), d)


def _tp_part(name: str, full: torch.Tensor, r: int, tp: int, cfg) -> torch.Tensor:
    """Rank r's part of a TP=1 parameter, computed here from the full one."""
    d = cfg.head_dim
    if name.endswith("qkv_proj.weight"):
        q, k, v = full.split([cfg.num_heads * d, cfg.num_kv_heads * d, cfg.num_kv_heads * d])
        return torch.cat([q.chunk(tp)[r], k.chunk(tp)[r], v.chunk(tp)[r]])
    if name.endswith("gate_up_proj.weight"):
        g, u = full.chunk(2)
        return torch.cat([g.chunk(tp)[r], u.chunk(tp)[r]])
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        return full.chunk(tp, dim=1)[r]
    if name.endswith(("embed_tokens.weight", "lm_head.weight")):
        return full.chunk(tp)[r]
    if name.endswith("w13"):
        g, u = full.chunk(2, dim=1)
        return torch.cat([g.chunk(tp, dim=1)[r], u.chunk(tp, dim=1)[r]], dim=1)
    if name.endswith("w2"):
        return full.chunk(tp, dim=2)[r]
    return full


_SHARDED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "embed_tokens", "lm_head")


@pytest.mark.parametrize("which", ["dense", "moe"])
def test_tp_rank_reads_only_its_slices(which, dense, moe):
    ckpt = dense if which == "dense" else moe
    cfg = load_config(ckpt)
    full = _params(_load(ckpt))
    for r in range(2):
        m, reads, sizes = _load_recorded(ckpt, ParallelContext(tp_rank=r, tp_size=2))
        for name, p in m.named_parameters():
            torch.testing.assert_close(p, _tp_part(name, full[name], r, 2, cfg), rtol=0, atol=0, msg=name)
        assert reads.keys() == sizes.keys()  # everything is read, once sliced ...
        for name, n in reads.items():
            sharded = any(s in name for s in _SHARDED)
            assert n == (sizes[name] // 2 if sharded else sizes[name]), name  # ... and a sharded tensor only half


def test_ep_rank_never_reads_other_experts(moe):
    full = _params(_load(moe))
    for r in range(2):
        m, reads, sizes = _load_recorded(moe, ParallelContext(ep_rank=r, ep_size=2))
        mine = range(4 * r, 4 * r + 4)
        for name, p in m.named_parameters():
            want = full[name][4 * r: 4 * r + 4] if name.endswith(("w13", "w2")) else full[name]
            torch.testing.assert_close(p, want, rtol=0, atol=0, msg=name)
        experts = {n for n in sizes if ".mlp.experts." in n}
        local = {n for n in experts if int(n.split(".mlp.experts.")[1].split(".")[0]) in mine}
        assert len(local) == len(experts) // 2
        assert not (experts - local) & reads.keys()  # other ranks' experts: not a byte read
        assert all(reads[n] == sizes[n] for n in local) and (sizes.keys() - experts) <= reads.keys()


def _fused(moe, tmp_path):
    """The MoE fixture rewritten with fused expert tensors: gate_up_proj [E, 2I, H] and down_proj [E, H, I]."""
    d = tmp_path / "fused"
    d.mkdir()
    shutil.copy(moe / "config.json", d / "config.json")
    t = load_file(str(moe / "model.safetensors"))
    cfg = load_config(moe)
    out = {k: v for k, v in t.items() if ".mlp.experts." not in k}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}.mlp.experts."
        E = range(cfg.num_experts)
        out[p + "gate_up_proj"] = torch.stack([torch.cat([t[f"{p}{e}.gate_proj.weight"], t[f"{p}{e}.up_proj.weight"]])
                                               for e in E])
        out[p + "down_proj"] = torch.stack([t[f"{p}{e}.down_proj.weight"] for e in E])
    save_file(out, str(d / "model.safetensors"))
    return d


@pytest.mark.parametrize("ctx", [ParallelContext(), ParallelContext(tp_rank=1, tp_size=2),
                                 ParallelContext(ep_rank=1, ep_size=2)], ids=["tp1", "tp2r1", "ep2r1"])
def test_fused_expert_tensors_load_lazily(moe, tmp_path, ctx):
    fused = _fused(moe, tmp_path)
    ref = _params(_load(moe, ctx))
    m, reads, sizes = _load_recorded(fused, ctx)
    for name, p in m.named_parameters():
        torch.testing.assert_close(p, ref[name], rtol=0, atol=0, msg=name)
    for name in (n for n in sizes if n.endswith(("experts.gate_up_proj", "experts.down_proj"))):
        assert reads[name] == (sizes[name] if ctx.tp_size == ctx.ep_size == 1 else sizes[name] // 2), name


def test_reads_stay_on_the_host_under_a_device_context(dense):
    ref = _params(_load(dense))
    m = Qwen3ForCausalLM(load_config(dense))
    with torch.device("meta"):  # as a CUDA rank loads inside `with torch.device("cuda")`
        load_checkpoint(m, dense)
    got = _params(m)
    assert all(torch.equal(ref[k], got[k]) for k in ref)
