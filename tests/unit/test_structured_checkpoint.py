"""`bench.structured_checkpoint` writes what the project's loader and server read: the qwen3-0.6b preset's config
(with the CPU-sized overrides), bf16 safetensors under the loader's names, Qwen3's stop ids, and a 151,646-token
tokenizer whose ChatML template renders a conversation into single special ids; the loaded model generates."""
import dataclasses
import json

import pytest
import torch

pytest.importorskip("transformers")
from safetensors import safe_open

from bench.structured_checkpoint import model_config, random_weights, write_checkpoint
from launch.options import load_tokenizer
from modeling.config import get_preset, load_config
from modeling.generate import generate
from modeling.generation_config import load_generation_config, stop_token_ids
from modeling.loader import expected_tensor_names, load_checkpoint
from modeling.qwen3 import Qwen3ForCausalLM

ENDOFTEXT, IM_START, IM_END = 151643, 151644, 151645


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("structured"), layers=2, hidden=64, intermediate=128, seed=3)


def test_config_is_the_preset_with_the_overrides(ckpt):
    cfg = load_config(ckpt)
    want = dataclasses.replace(get_preset("qwen3-0.6b"), num_layers=2, hidden_size=64, intermediate_size=128,
                               eos_token_ids=(IM_END,))
    assert cfg == want
    assert (cfg.vocab_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (151936, 16, 8, 128)
    assert cfg.tie_word_embeddings and cfg.rope_theta == 1e6 and cfg.max_position_embeddings == 40960
    assert cfg.dtype == torch.bfloat16
    assert json.loads((ckpt / "config.json").read_text())["bos_token_id"] == ENDOFTEXT


def test_weights_are_bf16_under_the_loaders_names(ckpt):
    with safe_open(str(ckpt / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        assert names == set(expected_tensor_names(load_config(ckpt))) and "lm_head.weight" not in names
        emb = f.get_slice("model.embed_tokens.weight")
        assert emb.get_dtype() == "BF16" and emb.get_shape() == [151936, 64]
        assert f.get_slice("model.layers.1.self_attn.q_proj.weight").get_shape() == [16 * 128, 64]
        assert f.get_slice("model.layers.1.self_attn.k_norm.weight").get_shape() == [128]


def test_random_weights_are_seeded_and_small():
    cfg = model_config(layers=1, dtype="float32", hidden=32, intermediate=48)
    a, b, c = random_weights(cfg, 0, 0.02), random_weights(cfg, 0, 0.02), random_weights(cfg, 1, 0.02)
    assert all(torch.equal(a[n], b[n]) for n in a) and not torch.equal(a["model.norm.weight"], c["model.norm.weight"])
    assert a["model.embed_tokens.weight"].dtype == torch.float32
    assert abs(a["model.embed_tokens.weight"].std().item() - 0.02) < 0.002
    assert abs(a["model.layers.0.input_layernorm.weight"].mean().item() - 1.0) < 0.1


def test_stop_ids_and_sampling_defaults(ckpt):
    cfg = load_config(ckpt)
    gen = load_generation_config(ckpt, cfg.vocab_size)
    assert stop_token_ids(cfg, gen) == (IM_END, ENDOFTEXT) and gen.top_k == 20 and gen.temperature == 0.6
    assert gen.bos_token_id == gen.pad_token_id == ENDOFTEXT


def test_tokenizer_is_qwen3_sized_with_a_chatml_template(ckpt):
    tok = load_tokenizer(str(ckpt))  # the server's loader
    assert tok is not None and len(tok) == 151646
    assert [tok.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")] == [
        ENDOFTEXT, IM_START, IM_END]
    assert tok.eos_token_id == IM_END and tok.pad_token_id == ENDOFTEXT
    msgs = [{"role": "system", "content": "Answer in JSON."}, {"role": "user", "content": 'Hi {"a": 1}'}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == ('<|im_start|>system\nAnswer in JSON.<|im_end|>\n<|im_start|>user\nHi {"a": 1}<|im_end|>\n'
                    "<|im_start|>assistant\n")
    ids = tok.encode(text, add_special_tokens=False)
    assert ids[0] == IM_START and ids.count(IM_START) == 3 and ids.count(IM_END) == 2
    assert tok.decode(ids) == text


def test_loads_and_greedy_generates(ckpt):
    model = Qwen3ForCausalLM(load_config(ckpt))
    load_checkpoint(model, ckpt)
    assert model.embed_tokens.weight.dtype == torch.bfloat16
    assert not torch.equal(model.layers[0].input_layernorm.weight, model.layers[1].input_layernorm.weight)
    prompt = [IM_START, 82, 88, 82, 83, IM_END]
    out = generate(model, [prompt], max_new_tokens=4).tokens[0]
    assert len(out) == 4 and all(0 <= t < 151936 for t in out)
    assert generate(model, [prompt], max_new_tokens=4).tokens[0] == out  # greedy: deterministic
