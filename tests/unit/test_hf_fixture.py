"""The real-format checkpoint fixture is what transformers and tokenizers make and read: the tokenizer
round-trips text (multi-byte UTF-8 included), the chat template is Qwen3's shape, the files are HF's layout,
and a checkpoint builds in under 5 s."""
import json
import time

import pytest

transformers = pytest.importorskip("transformers")

from tests.fixtures.hf_checkpoints import SPECIAL_TOKENS, build_checkpoint, hf_model

TEXTS = ["The quick brown fox.", "Le café est très bon, naïve élève.", "日本語のテキスト 日本", " leading space",
         "two\nlines\n\n", "emoji ✓ → ★ and 中文", "unseen: Ωmega ζ ₿ 🙂 \t tab", ""]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("fixture"))


@pytest.fixture(scope="module")
def tok(ckpt):
    return transformers.AutoTokenizer.from_pretrained(ckpt)


def test_files_are_hf_layout(ckpt):
    names = {p.name for p in ckpt.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json"} <= names
    cfg = json.loads((ckpt / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3ForCausalLM"] and isinstance(cfg["eos_token_id"], int)


@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_round_trips(tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    if "é" in text or "日本" in text:  # trained on the corpus: merged, not left as single bytes
        assert len(ids) < len(text.encode("utf-8"))


def test_special_tokens_are_single_ids_inside_the_vocab(ckpt, tok):
    vocab = transformers.AutoConfig.from_pretrained(ckpt).vocab_size
    assert vocab >= len(tok)
    ids = [tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS]
    assert len(set(ids)) == len(ids) and all(0 <= i < vocab for i in ids)
    text = "<|im_start|>user\nhi<|im_end|>"
    enc = tok.encode(text, add_special_tokens=False)
    assert enc[0] == tok.convert_tokens_to_ids("<|im_start|>") and enc[-1] == tok.convert_tokens_to_ids("<|im_end|>")
    assert tok.decode(enc) == text and tok.decode(enc, skip_special_tokens=True) == "user\nhi"
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"


def test_chat_template_is_qwen3_shaped(tok):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi é"}]
    body = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi é<|im_end|>\n"
    render = lambda **kw: tok.apply_chat_template(msgs, tokenize=False, **kw)
    assert render() == body
    assert render(add_generation_prompt=True) == body + "<|im_start|>assistant\n"
    assert render(add_generation_prompt=True, enable_thinking=True) == body + "<|im_start|>assistant\n"
    assert render(add_generation_prompt=True, enable_thinking=False) == (
        body + "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    history = msgs + [{"role": "assistant", "content": "<think>\nhmm\n</think>\n\nHello."},
                      {"role": "user", "content": "Again"}]
    out = tok.apply_chat_template(history, tokenize=False, add_generation_prompt=True)
    assert "<|im_start|>assistant\nHello.<|im_end|>\n<|im_start|>user\nAgain<|im_end|>\n" in out and "hmm" not in out
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, enable_thinking=False)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert tok.decode(ids) == render(add_generation_prompt=True, enable_thinking=False)


@pytest.mark.parametrize("kw", [dict(), dict(moe=True), dict(shards=3),
                                dict(rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                   "original_max_position_embeddings": 64})])
def test_variants_load_in_transformers_and_build_fast(tmp_path, kw):
    t0 = time.perf_counter()
    d = build_checkpoint(tmp_path, **kw)
    assert time.perf_counter() - t0 < 5.0
    model = hf_model(d)
    assert model.config.dtype == transformers.AutoConfig.from_pretrained(d).dtype
    if kw.get("moe"):
        assert type(model).__name__ == "Qwen3MoeForCausalLM" and model.config.num_experts == 8
    if kw.get("shards"):
        index = json.loads((d / "model.safetensors.index.json").read_text())
        files = set(index["weight_map"].values())
        assert len(files) >= 3 and all((d / f).is_file() for f in files)
        assert not (d / "model.safetensors").exists()
    if kw.get("rope_scaling"):
        rp = model.config.rope_parameters
        assert rp["rope_type"] == "yarn" and rp["factor"] == 4.0 and model.config.max_position_embeddings == 256
