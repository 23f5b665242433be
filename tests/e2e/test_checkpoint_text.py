"""`graphline serve --model <HF checkpoint dir>` with a tokenizer: text prompts in, text out (plain and
streamed), identical tokens to the token-id form of the same prompt."""
from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
import torch

from e2e_support import graphline, start_server

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from modeling.config import get_preset

    d = tmp_path_factory.mktemp("ckpt") / "tiny-chat"
    cfg = get_preset("qwen3-tiny").to_hf_dict()
    hf_cfg = transformers.Qwen3Config(**{k: v for k, v in cfg.items() if k != "architectures"})
    torch.manual_seed(7)
    transformers.Qwen3ForCausalLM(hf_cfg).float().save_pretrained(d)
    vocab = {f"w{i}": i for i in range(hf_cfg.vocab_size)}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tok.decoder = tokenizers.decoders.WordPiece(prefix="##")  # joins words with spaces
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0").save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def text_server(checkpoint):
    srv = start_server(graphline("serve", "--model", str(checkpoint), "--executor", "local", "--device", "cpu",
                                 "--max-model-len", "64", "--max-decode-batch", "4", "--pcg-max-tokens", "0",
                                 "--no-progress", "--port", "0"))
    yield srv
    srv.stop()


def test_text_prompts_with_the_checkpoint_tokenizer(text_server):
    url = text_server.url

    async def main():
        async with aiohttp.ClientSession() as s:
            async with s.get(url + "/v1/models") as r:
                name = (await r.json())["data"][0]["id"]
            body = {"model": name, "max_tokens": 6, "temperature": 0}
            async with s.post(url + "/v1/completions", json={**body, "prompt": "w5 w17 w3"}) as r:
                text = (r.status, await r.json())
            async with s.post(url + "/v1/completions", json={**body, "prompt": [5, 17, 3]}) as r:
                ids = await r.json()
            streamed = ""
            async with s.post(url + "/v1/completions", json={**body, "prompt": ["w5 w17 w3"], "stream": True}) as r:
                async for raw in r.content:
                    line = raw.decode().strip()
                    if line.startswith("data: {"):
                        streamed += "".join(c["text"] for c in json.loads(line[6:])["choices"])
        return name, text, ids, streamed

    name, (status, text), ids, streamed = asyncio.run(main())
    assert name == "tiny-chat" and status == 200, text
    choice = text["choices"][0]
    assert choice["token_ids"] == ids["choices"][0]["token_ids"]
    assert choice["text"] == " ".join(f"w{t}" for t in choice["token_ids"])
    assert streamed.strip() == choice["text"] and ids["choices"][0]["text"] == choice["text"]
    assert text["usage"]["prompt_tokens"] == 3
