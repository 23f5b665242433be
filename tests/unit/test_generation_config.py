"""generation_config.json: what transformers writes is read (stop ids, sampling defaults) and agrees with
transformers' own reader; bad or unknown fields are a ConfigError naming the field."""
import json

import pytest

transformers = pytest.importorskip("transformers")

from modeling.config import ConfigError, load_config
from modeling.generation_config import (GenerationDefaults, generation_config_from_dict, load_generation_config,
                                        stop_token_ids)
from tests.fixtures.hf_checkpoints import build_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("gen"))


def test_fixture_generation_config_matches_transformers(ckpt):
    cfg = load_config(ckpt)
    ours = load_generation_config(ckpt, vocab_size=cfg.vocab_size)
    ref = transformers.GenerationConfig.from_pretrained(ckpt)
    assert isinstance(ref.eos_token_id, list) and len(ref.eos_token_id) == 2
    assert ours.eos_token_ids == tuple(ref.eos_token_id)
    assert (ours.temperature, ours.top_p, ours.top_k) == (ref.temperature, ref.top_p, ref.top_k)
    assert (ours.bos_token_id, ours.pad_token_id, ours.do_sample) == (ref.bos_token_id, ref.pad_token_id, ref.do_sample)
    assert ours.min_p is None and ours.repetition_penalty is None
    tok = transformers.AutoTokenizer.from_pretrained(ckpt)
    assert ours.eos_token_ids == (tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>"))
    # config.json's single eos id is the fallback; generation_config.json's list wins
    assert cfg.eos_token_ids == (transformers.AutoConfig.from_pretrained(ckpt).eos_token_id,)
    assert stop_token_ids(cfg, ours) == ours.eos_token_ids
    assert stop_token_ids(cfg, None) == stop_token_ids(cfg, GenerationDefaults()) == cfg.eos_token_ids


def test_every_field_transformers_writes_is_accepted(tmp_path):
    full = transformers.GenerationConfig(eos_token_id=[3, 4], temperature=0.7, top_p=0.9, top_k=40, min_p=0.05,
                                         repetition_penalty=1.1, max_new_tokens=64, do_sample=True)
    full.save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "generation_config.json").read_text())
    everything = {**full.to_dict(), **raw}  # every field this transformers version defines, defaults included
    got = generation_config_from_dict(everything)
    assert got == GenerationDefaults(eos_token_ids=(3, 4), do_sample=True, temperature=0.7, top_p=0.9, top_k=40,
                                     min_p=0.05, repetition_penalty=1.1, max_new_tokens=64)
    assert load_generation_config(tmp_path) == got


def test_no_file_is_none(tmp_path):
    assert load_generation_config(tmp_path) is None


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d.update(eos_token_ids=[1]), r"field 'eos_token_ids' is not a generation config field"),
    (lambda d: d.update(eos_token_id="<|im_end|>"), r"'eos_token_id' must be a non-negative int"),
    (lambda d: d.update(eos_token_id=[1, -2]), r"'eos_token_id'"),
    (lambda d: d.update(eos_token_id=[1, 5000]), r"'eos_token_id' = 5000 is outside the vocabulary"),
    (lambda d: d.update(pad_token_id=[1, 2]), r"'pad_token_id' must be a non-negative int"),
    (lambda d: d.update(temperature=-0.5), r"'temperature' must be a number >= 0"),
    (lambda d: d.update(temperature="hot"), r"'temperature'"),
    (lambda d: d.update(top_p=0.0), r"'top_p' must be a number in \(0, 1\]"),
    (lambda d: d.update(top_p=1.5), r"'top_p'"),
    (lambda d: d.update(top_k=2.5), r"'top_k' must be an int"),
    (lambda d: d.update(top_k=True), r"'top_k'"),
    (lambda d: d.update(min_p=2), r"'min_p'"),
    (lambda d: d.update(repetition_penalty=0), r"'repetition_penalty' must be a number > 0"),
    (lambda d: d.update(do_sample="yes"), r"'do_sample' must be a bool"),
    (lambda d: d.update(max_new_tokens=0), r"'max_new_tokens'"),
])
def test_malformed_fields_name_the_field(ckpt, tmp_path, mutate, message):
    d = json.loads((ckpt / "generation_config.json").read_text())
    mutate(d)
    (tmp_path / "generation_config.json").write_text(json.dumps(d))
    with pytest.raises(ConfigError, match=message):
        load_generation_config(tmp_path, vocab_size=640)


@pytest.mark.parametrize("text, message", [("{not json", "not valid JSON"), ("[1, 2]", "must hold a JSON object")])
def test_malformed_file(tmp_path, text, message):
    (tmp_path / "generation_config.json").write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_generation_config(tmp_path)
