"""Bad input raises a clear, named error and leaves the KV cache untouched."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from modeling.config import ConfigError, UnknownPresetError, get_preset, load_config
from modeling.generate import TokenIdError, generate
from modeling.kv_cache import CacheCapacityError, KVCacheSpec, PagedKVCache
from modeling.loader import CheckpointError, init_random, load_checkpoint, save_checkpoint
from modeling.qwen3 import Qwen3ForCausalLM


@pytest.fixture(scope="module")
def tiny():
    m = Qwen3ForCausalLM(get_preset("qwen3-tiny"))
    init_random(m, seed=0)
    return m


def _snapshot(cache):
    return [(k.clone(), v.clone()) for k, v in cache.layers]


def _unchanged(cache, snap):
    return all(torch.equal(k, k0) and torch.equal(v, v0) for (k, v), (k0, v0) in zip(cache.layers, snap))


def test_unknown_preset_names_known_ones():
    with pytest.raises(UnknownPresetError, match="qwen3-tiny"):
        get_preset("qwen3-huge")


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda d: d.pop("hidden_size"), "missing required field 'hidden_size'"),
        (lambda d: d.update(num_attention_heads=5), "not a multiple"),
        (lambda d: d.update(hidden_size="64"), "must be int"),
        (lambda d: d.update(architectures=["LlamaForCausalLM"]), "unsupported architectures"),
        (lambda d: d.update(torch_dtype="float8"), "torch_dtype"),
    ],
)
def test_malformed_config(tmp_path, mutate, message):
    d = get_preset("qwen3-tiny").to_hf_dict()
    mutate(d)
    (tmp_path / "config.json").write_text(json.dumps(d))
    with pytest.raises(ConfigError, match=message):
        load_config(tmp_path)


def test_config_not_json(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_config(tmp_path)


def test_moe_topk_larger_than_experts(tmp_path):
    d = get_preset("qwen3-moe-tiny").to_hf_dict()
    d["num_experts_per_tok"] = 99
    (tmp_path / "config.json").write_text(json.dumps(d))
    with pytest.raises(ConfigError, match="num_experts_per_tok"):
        load_config(tmp_path)


@pytest.mark.parametrize("preset", ["qwen3-tiny", "qwen3-moe-tiny"])
def test_missing_extra_and_misshaped_tensors(tmp_path, preset):
    cfg = get_preset(preset)
    save_checkpoint(cfg, tmp_path, seed=0)
    f = tmp_path / "model.safetensors"
    full = load_file(str(f))
    victim = "model.layers.1.self_attn.k_proj.weight"

    save_file({k: v for k, v in full.items() if k != victim}, str(f))
    with pytest.raises(CheckpointError, match="missing tensor.*k_proj"):
        load_checkpoint(Qwen3ForCausalLM(cfg), tmp_path)

    save_file({**full, "model.layers.0.mlp.bogus.weight": torch.zeros(2)}, str(f))
    with pytest.raises(CheckpointError, match="unexpected tensor model.layers.0.mlp.bogus.weight"):
        load_checkpoint(Qwen3ForCausalLM(cfg), tmp_path)

    save_file({**full, victim: torch.zeros(3, 3)}, str(f))
    with pytest.raises(CheckpointError, match="k_proj.*shape"):
        load_checkpoint(Qwen3ForCausalLM(cfg), tmp_path)


def test_token_id_out_of_range_leaves_cache_untouched(tiny):
    cache = PagedKVCache(KVCacheSpec.for_model(tiny.config, 16, 4), "cpu")
    snap = _snapshot(cache)
    with pytest.raises(TokenIdError, match="512"):
        generate(tiny, [[1, 2, 3], [4, 512]], max_new_tokens=2, kv_cache=cache)
    with pytest.raises(TokenIdError, match="-1"):
        generate(tiny, [[1, -1]], max_new_tokens=2, kv_cache=cache)
    assert _unchanged(cache, snap)


def test_sequence_longer_than_cache_leaves_cache_untouched(tiny):
    cache = PagedKVCache(KVCacheSpec.for_model(tiny.config, 4, 4), "cpu")  # 3 usable blocks = 12 tokens
    snap = _snapshot(cache)
    with pytest.raises(CacheCapacityError, match="KV blocks"):
        generate(tiny, [list(range(1, 11))], max_new_tokens=8, kv_cache=cache)
    with pytest.raises(CacheCapacityError, match="max_position_embeddings"):
        generate(tiny, [[1] * 4090], max_new_tokens=16, kv_cache=cache)
    assert _unchanged(cache, snap)


def test_kv_budget_too_small():
    with pytest.raises(CacheCapacityError, match="at least 2"):
        KVCacheSpec.from_memory_budget(get_preset("qwen3-tiny"), 100)
