"""RoPE scaling (linear, YaRN): config parsing names bad fields, our tables equal transformers' rotary embedding,
and the whole model loaded from a real-format YaRN / linear checkpoint gives transformers' logits past the
original context length."""
import dataclasses
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

from modeling.config import ConfigError, RopeScaling, config_from_dict, get_preset, load_config
from modeling.loader import load_checkpoint
from modeling.qwen3 import Qwen3ForCausalLM
from modeling.rope import rope_tables
from tests.fixtures.hf_checkpoints import build_checkpoint, hf_model
from tests.fixtures.paged import prefill_logits

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}

ROPES = [
    None,
    {"rope_type": "linear", "factor": 2.0},
    YARN,
    {**YARN, "factor": 8.0, "beta_fast": 16.0, "beta_slow": 2.0},
    {**YARN, "attention_factor": 0.8},
    {**YARN, "mscale": 0.707, "mscale_all_dim": 1.0},
    {**YARN, "truncate": False},
    {**YARN, "original_max_position_embeddings": 4096},  # a correction range inside the head, not clamped to 0
    {**YARN, "original_max_position_embeddings": 4096, "truncate": False},
    {"rope_type": "yarn", "factor": None, "original_max_position_embeddings": 64},  # factor inferred: 256 / 64
]


def _hf_config(rope, head_dim=16, max_pos=256, theta=10000.0):
    kw = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim,
              max_position_embeddings=max_pos, rope_theta=theta)
    if rope is not None:
        kw["rope_scaling"] = dict(rope)
    return transformers.Qwen3Config(**kw)


def _ours(hf_cfg) -> tuple[float, RopeScaling | None]:
    cfg = config_from_dict({**get_preset("qwen3-tiny").to_hf_dict(), **json.loads(hf_cfg.to_json_string())})
    return cfg.rope_theta, cfg.rope_scaling


@pytest.mark.parametrize("rope", ROPES, ids=lambda r: "default" if r is None else json.dumps(r))
@pytest.mark.parametrize("head_dim", [16, 128])
def test_tables_equal_transformers_rotary(rope, head_dim):
    hf_cfg = _hf_config(rope, head_dim=head_dim, theta=1_000_000.0 if head_dim == 128 else 10000.0)
    theta, scaling = _ours(hf_cfg)  # parsed from the config.json transformers writes
    cos, sin = rope_tables(head_dim, 256, theta, scaling)
    assert cos.dtype == sin.dtype == torch.float32 and cos.shape == (256, head_dim)
    positions = torch.arange(256).unsqueeze(0)
    ref_cos, ref_sin = Qwen3RotaryEmbedding(hf_cfg)(torch.zeros(1, dtype=torch.float32), positions)
    torch.testing.assert_close(cos, ref_cos[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(sin, ref_sin[0], rtol=1e-6, atol=1e-6)


def test_scaled_tables_differ_from_plain():
    """The comparison above can fail: YaRN moves the low frequencies and scales both tables."""
    plain = rope_tables(16, 256, 10000.0, None)
    _, yarn = _ours(_hf_config(YARN))
    assert yarn.attention_scaling == pytest.approx(0.1 * torch.log(torch.tensor(4.0)).item() + 1)
    scaled = rope_tables(16, 256, 10000.0, yarn)
    assert (scaled[0] - plain[0]).abs().max() > 0.1


@pytest.mark.parametrize("kw", [
    dict(rope=YARN),
    dict(rope={"rope_type": "linear", "factor": 2.0}),
    dict(rope=YARN, moe=True),
])
def test_model_logits_equal_transformers_past_original_context(tmp_path, kw):
    ckpt = build_checkpoint(tmp_path, moe=kw.get("moe", False), rope_scaling=kw["rope"], seed=3)
    cfg = load_config(ckpt)
    assert cfg.rope_scaling is not None and cfg.rope_scaling.rope_type == kw["rope"]["rope_type"]
    ours = Qwen3ForCausalLM(cfg)
    load_checkpoint(ours, ckpt)
    hf = hf_model(ckpt)
    assert hf.config.rope_parameters["rope_type"] == kw["rope"]["rope_type"]
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, cfg.vocab_size, (100,), generator=g).tolist(),  # longer than the original 64
               torch.randint(0, cfg.vocab_size, (7,), generator=g).tolist()]
    got = prefill_logits(ours, prompts, block_size=16)
    with torch.no_grad():
        ref = [hf(torch.tensor([p])).logits[0].float() for p in prompts]
    for g_, r in zip(got, ref):
        torch.testing.assert_close(g_, r, atol=5e-5, rtol=5e-5)
    # The comparison can fail: the same weights with plain RoPE are far from transformers' logits past position 64.
    plain = Qwen3ForCausalLM(dataclasses.replace(cfg, rope_scaling=None))
    load_checkpoint_weights_from(plain, ours)
    far = prefill_logits(plain, prompts[:1], block_size=16)[0]
    assert (far[64:] - ref[0][64:]).abs().max() > 100 * 5e-5


def load_checkpoint_weights_from(dst, src) -> None:
    with torch.no_grad():
        for (n, p), (_, q) in zip(dst.named_parameters(), src.named_parameters()):
            p.copy_(q)


def test_rope_scaling_round_trips_and_hashes():
    _, yarn = _ours(_hf_config({**YARN, "beta_fast": 16.0, "mscale": 0.5, "mscale_all_dim": 1.0, "truncate": False}))
    cfg = dataclasses.replace(get_preset("qwen3-tiny"), max_position_embeddings=256, rope_scaling=yarn,
                              eos_token_ids=(3, 7))
    again = config_from_dict(cfg.to_hf_dict())
    assert again == cfg and hash(again) == hash(cfg) and again.rope_scaling == yarn
    assert {cfg: 1}[again] == 1
    # transformers reads our config.json back to the same rotary embedding
    hf_cfg = transformers.Qwen3Config(**{k: v for k, v in cfg.to_hf_dict().items() if k != "architectures"})
    assert hf_cfg.rope_parameters["beta_fast"] == 16.0 and hf_cfg.rope_parameters["truncate"] is False
    linear = config_from_dict({**cfg.to_hf_dict(), "rope_scaling": {"type": "linear", "factor": 2}})
    assert linear.rope_scaling == RopeScaling("linear", 2.0)
    plain = config_from_dict({**get_preset("qwen3-tiny").to_hf_dict(),
                              "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}})
    assert plain == get_preset("qwen3-tiny")


@pytest.mark.parametrize("field, value, message", [
    ("rope_scaling", {"rope_type": "dynamic", "factor": 2.0}, r"rope_scaling\.rope_type.*'dynamic'.*default, linear, yarn"),
    ("rope_parameters", {"rope_type": "longrope", "rope_theta": 1e4}, r"rope_parameters\.rope_type.*'longrope'.*supported"),
    ("rope_scaling", {"type": "llama3", "factor": 8.0}, r"rope_scaling\.rope_type.*'llama3'"),
    ("rope_scaling", {"rope_type": "yarn", "factor": 4.0, "low_freq_factor": 1.0}, r"rope_scaling\.low_freq_factor"),
    ("rope_scaling", {"rope_type": "linear"}, r"rope_scaling\.factor"),
    ("rope_scaling", {"rope_type": "linear", "factor": "2"}, r"rope_scaling\.factor.*must be float"),
    ("rope_scaling", {"rope_type": "linear", "factor": -1.0}, r"rope_scaling\.factor must be positive"),
    ("rope_scaling", {**YARN, "original_max_position_embeddings": 6.5}, r"original_max_position_embeddings"),
    ("rope_scaling", {**YARN, "attention_factor": 0.0}, r"attention_factor"),
    ("rope_scaling", {**YARN, "partial_rotary_factor": 0.5}, r"partial_rotary_factor"),
    ("rope_scaling", "yarn", r"'rope_scaling' must be an object"),
    ("rope_parameters", {"rope_type": "yarn", "factor": 4.0, "rope_theta": "big"}, r"rope_parameters\.rope_theta"),
    ("architectures", ["LlamaForCausalLM"], r"'architectures'.*LlamaForCausalLM.*Qwen3ForCausalLM, Qwen3MoeForCausalLM"),
    ("model_type", "qwen3_moe", r"'model_type'.*qwen3_moe"),
    ("eos_token_id", 512, r"eos_token_id 512 is outside the vocabulary"),
    ("eos_token_id", [1, "2"], r"'eos_token_id'"),
    ("eos_token_id", True, r"'eos_token_id'"),
])
def test_bad_rope_arch_and_eos_fields_name_the_field(tmp_path, field, value, message):
    d = get_preset("qwen3-tiny").to_hf_dict()
    d[field] = value
    (tmp_path / "config.json").write_text(json.dumps(d))
    with pytest.raises(ConfigError, match=message):
        load_config(tmp_path)


@pytest.mark.parametrize("value, ids", [(None, ()), (7, (7,)), ([7, 9, 7], (7, 9))])
def test_config_eos_token_id_forms(value, ids):
    cfg = config_from_dict({**get_preset("qwen3-tiny").to_hf_dict(), "eos_token_id": value})
    assert cfg.eos_token_ids == ids
