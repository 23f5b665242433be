"""`graphline serve` on real-format checkpoints (`tests.fixtures.hf_checkpoints`: saved by transformers, a BPE
tokenizer trained in the fixture, a chat template, `generation_config.json` with a multi-element `eos_token_id`,
several safetensors shards with an index), through the official `openai` client on 127.0.0.1:

- greedy tokens equal transformers' own greedy generation of the same checkpoint;
- generation stops at an EOS id listed in `generation_config.json` (the fixture's list is extended with a token
  the greedy model emits at a known step), the EOS token is counted but its text is not returned, and
  `ignore_eos` runs on;
- `/v1/models` shows the checkpoint's generation defaults, and a request that omits `temperature` samples with
  them while an explicit value overrides;
- chat completions, streamed and not, with a system message, equal the chat template applied by transformers
  plus a completion of the same tokens;
- a Qwen3-MoE checkpoint serves the tokens transformers generates.
"""
from __future__ import annotations

import json

import pytest
import torch

from e2e_support import openai_client, serve_checkpoint
from tests.fixtures.hf_checkpoints import build_checkpoint, hf_model

openai = pytest.importorskip("openai", reason="the official openai client is a test dependency")
transformers = pytest.importorskip("transformers")

PROMPT = "The quick brown fox"
EOS_STEP = 3  # the greedy model's token at this step is made an EOS id


def _hf_greedy(directory, ids: list[int], n: int) -> list[int]:
    model = hf_model(directory)
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
    return out[0, len(ids):].tolist()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = build_checkpoint(tmp_path_factory.mktemp("real") / "qwen3-fixture", shards=3)
    tok = transformers.AutoTokenizer.from_pretrained(str(d), local_files_only=True)
    ids = tok.encode(PROMPT)
    greedy = _hf_greedy(d, ids, 12)
    gen = json.loads((d / "generation_config.json").read_text())
    eos = greedy[EOS_STEP]
    assert eos not in greedy[:EOS_STEP], "pick another step: the token appears earlier"
    gen["eos_token_id"] = [*gen["eos_token_id"], eos]
    (d / "generation_config.json").write_text(json.dumps(gen))
    return d, tok, ids, greedy, gen


@pytest.fixture(scope="module")
def srv(ckpt):
    d = ckpt[0]
    s = serve_checkpoint(d)
    yield s
    s.stop()


def test_greedy_tokens_equal_transformers_and_eos_from_generation_config_stops(srv, ckpt):
    d, tok, ids, greedy, gen = ckpt
    c = openai_client(srv)
    model = d.name
    full = c.completions.create(model=model, prompt=ids, max_tokens=12, temperature=0,
                                extra_body={"ignore_eos": True})
    assert full.choices[0].model_extra["token_ids"] == greedy and full.choices[0].finish_reason == "length"
    stopped = c.completions.create(model=model, prompt=ids, max_tokens=12, temperature=0)
    ch = stopped.choices[0]
    assert ch.finish_reason == "stop" and ch.model_extra["token_ids"] == greedy[:EOS_STEP + 1]
    assert stopped.usage.completion_tokens == EOS_STEP + 1  # the EOS token is counted ...
    assert ch.text == tok.decode(greedy[:EOS_STEP], skip_special_tokens=True)  # ... but returns no text


def test_generation_defaults_are_shown_and_applied(srv, ckpt):
    d, tok, ids, greedy, gen = ckpt
    c = openai_client(srv)
    card = c.models.retrieve(d.name)
    defaults = card.model_extra["generation_defaults"]
    assert defaults["temperature"] == gen["temperature"] and defaults["top_p"] == gen["top_p"]
    assert defaults["top_k"] == gen["top_k"] and defaults["eos_token_id"] == gen["eos_token_id"]
    kw = dict(model=d.name, prompt=ids, max_tokens=12, extra_body={"ignore_eos": True})
    sampled = [c.completions.create(seed=s, **kw).choices[0].model_extra["token_ids"] for s in range(4)]
    assert any(t != greedy for t in sampled)  # the default temperature (0.6) samples
    assert c.completions.create(seed=0, **kw).choices[0].model_extra["token_ids"] == sampled[0]  # seeded
    assert c.completions.create(temperature=0, **kw).choices[0].model_extra["token_ids"] == greedy  # override


def test_chat_equals_the_template_plus_a_completion(srv, ckpt):
    d, tok, ids, greedy, gen = ckpt
    c = openai_client(srv)
    messages = [{"role": "system", "content": "You answer briefly."}, {"role": "user", "content": "hello there"}]
    templated = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    templated = list(templated["input_ids"]) if hasattr(templated, "keys") else list(templated)
    ref = c.completions.create(model=d.name, prompt=templated, max_tokens=10, temperature=0,
                               extra_body={"ignore_eos": True})
    chat = c.chat.completions.create(model=d.name, messages=messages, max_tokens=10, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert chat.usage.prompt_tokens == len(templated)
    assert chat.choices[0].message.role == "assistant"
    assert chat.choices[0].message.content == ref.choices[0].text
    chunks = list(c.chat.completions.create(model=d.name, messages=messages, max_tokens=10, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == ref.choices[0].text


def test_a_moe_checkpoint_serves_transformers_tokens(tmp_path):
    d = build_checkpoint(tmp_path / "qwen3-moe-fixture", moe=True, shards=2)
    tok = transformers.AutoTokenizer.from_pretrained(str(d), local_files_only=True)
    ids = tok.encode(PROMPT)
    want = _hf_greedy(d, ids, 8)
    s = serve_checkpoint(d, max_model_len=64, max_decode_batch=2)
    try:
        out = openai_client(s).completions.create(model=d.name, prompt=ids, max_tokens=8, temperature=0,
                                            extra_body={"ignore_eos": True})
    finally:
        s.stop()
    assert out.choices[0].model_extra["token_ids"] == want


def test_logprobs_in_the_openai_shapes(srv, ckpt):
    d, tok, ids, greedy, gen = ckpt
    c = openai_client(srv)
    out = c.completions.create(model=d.name, prompt=ids, max_tokens=6, temperature=0, logprobs=3,
                               extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    assert out.choices[0].model_extra["token_ids"] == greedy[:6]
    assert lp.tokens == [tok.decode([t]) for t in greedy[:6]] and len(lp.token_logprobs) == 6
    # keyed by token text (the OpenAI shape): byte tokens that decode alike share a key
    assert all(1 <= len(t) <= 3 for t in lp.top_logprobs) and all(v <= 0 for v in lp.token_logprobs)
    # greedy: the chosen token is the most probable one, and its logprob is the top one
    assert all(max(top.values()) == pytest.approx(chosen, abs=1e-5) for top, chosen in
               zip(lp.top_logprobs, lp.token_logprobs))
    assert lp.text_offset == [sum(len(s) for s in lp.tokens[:i]) for i in range(6)]
    streamed = list(c.completions.create(model=d.name, prompt=ids, max_tokens=6, temperature=0, logprobs=3,
                                         stream=True, extra_body={"ignore_eos": True}))
    assert [v for ch in streamed if ch.choices and ch.choices[0].logprobs
            for v in ch.choices[0].logprobs.token_logprobs] == pytest.approx(lp.token_logprobs, abs=1e-6)
    chat = c.chat.completions.create(model=d.name, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                     temperature=0, logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(x.top_logprobs) == 2 and x.logprob <= 0 for x in content)
    assert all(x.logprob == pytest.approx(x.top_logprobs[0].logprob, abs=1e-5) for x in content)  # greedy


def test_penalties_bias_and_min_p_are_applied(srv, ckpt):
    d, tok, ids, greedy, gen = ckpt
    c = openai_client(srv)
    kw = dict(model=d.name, prompt=ids, max_tokens=8, temperature=0)
    forced = c.completions.create(**kw, logit_bias={str(greedy[0] + 1): 100},
                                  extra_body={"ignore_eos": True}).choices[0].model_extra["token_ids"]
    assert forced == [greedy[0] + 1] * 8
    rep = c.completions.create(**kw, extra_body={"ignore_eos": True, "repetition_penalty": 2.0})
    assert rep.choices[0].model_extra["token_ids"] != greedy[:8] or len(set(greedy[:8])) == 8
    with pytest.raises(openai.BadRequestError):
        c.completions.create(**kw, extra_body={"min_p": 2})
