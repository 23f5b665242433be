"""The real aiohttp app in-process (`aiohttp.test_utils.TestServer` on 127.0.0.1) over the local executor and the
tiny chat checkpoint: generation defaults, chat without a template or tokenizer, admin protection, stop strings
freeing their blocks, body limits. Nothing is faked: a real `ServerState`, engine thread, model and tokenizer."""
from __future__ import annotations

import asyncio
import contextlib
from typing import Optional

import pytest

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from aiohttp.test_utils import TestClient, TestServer  # noqa: E402

from chat_fixture import build_checkpoint  # noqa: E402

PROMPT = [11, 40, 300, 7, 99]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-chat")


@pytest.fixture(scope="module")
def executor(checkpoint):
    from actors.rank import RuntimeConfig
    from engine import LocalEngineExecutor
    from graphrunner.config import GraphRunnerConfig

    rt = RuntimeConfig(model=str(checkpoint), device="cpu", block_size=16, num_kv_blocks=24, max_model_len=128,
                       graph=GraphRunnerConfig(eager_mode=True, max_decode_batch=0, pcg_max_tokens=None))
    ex = LocalEngineExecutor(rt)
    ex.start(progress=False)
    yield ex
    ex.shutdown()


@pytest.fixture(scope="module")
def tokenizer(checkpoint):
    from launch.options import load_tokenizer

    return load_tokenizer(str(checkpoint))


@contextlib.asynccontextmanager
async def serve(executor, tokenizer, **state_kw):
    from engine import AsyncLLMEngine, EngineConfig, LLMEngine
    from launch.metrics import ServerMetrics
    from launch.server import ServerState, build_app

    metrics = ServerMetrics()
    state = ServerState(engine=AsyncLLMEngine(LLMEngine(executor, EngineConfig(max_num_seqs=8)), metrics),
                        metrics=metrics, model_name="tiny-chat", tokenizer=tokenizer, **state_kw)
    state.engine.start()
    try:
        async with TestClient(TestServer(build_app(state), host="127.0.0.1")) as client:
            yield client, state
    finally:
        state.engine.shutdown()


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 120))


async def tokens(client, body: dict, path: str = "/v1/completions") -> tuple[list[int], Optional[str]]:
    r = await client.post(path, json={"prompt": PROMPT, **body})
    j = await r.json()
    assert r.status == 200, j
    return j["choices"][0]["token_ids"], j["choices"][0]["finish_reason"]


def test_generation_defaults_apply_when_omitted_and_explicit_values_override(executor, tokenizer):
    defaults = {"temperature": 0.8, "top_k": 40, "max_new_tokens": 6, "do_sample": True}

    async def main():
        async with serve(executor, tokenizer, generation_defaults=defaults) as (c, _):
            omitted = await tokens(c, {"seed": 11})
            explicit = await tokens(c, {"seed": 11, "temperature": 0.8, "top_k": 40, "max_tokens": 6})
            greedy = await tokens(c, {"temperature": 0, "max_tokens": 6})
            longer = await tokens(c, {"temperature": 0, "max_tokens": 9})
            card = await (await c.get("/v1/models/tiny-chat")).json()
            listed = await (await c.get("/v1/models")).json()
        async with serve(executor, tokenizer) as (c, _):
            plain_seeded = await tokens(c, {"seed": 11, "max_tokens": 6})  # OpenAI defaults: temperature 1, no top_k
            plain_greedy = await tokens(c, {"temperature": 0, "max_tokens": 6})
            plain_card = await (await c.get("/v1/models/tiny-chat")).json()
        return omitted, explicit, greedy, longer, card, listed, plain_seeded, plain_greedy, plain_card

    omitted, explicit, greedy, longer, card, listed, plain_seeded, plain_greedy, plain_card = run(main())
    assert omitted == explicit and len(omitted[0]) == 6  # the defaults are what an explicit request gets
    assert omitted != greedy == plain_greedy  # explicit temperature 0 overrides the default
    assert omitted != plain_seeded  # and the defaults change what an omitted field means
    assert longer[0][:6] == greedy[0] and len(longer[0]) == 9
    assert card["generation_defaults"] == {"temperature": 0.8, "top_k": 40, "max_tokens": 6}
    assert listed["data"][0]["generation_defaults"] == card["generation_defaults"]
    assert plain_card["generation_defaults"] == {}


def test_eos_default_stops_generation_unless_ignore_eos(executor, tokenizer):
    async def main():
        async with serve(executor, tokenizer) as (c, _):
            ref, _ = await tokens(c, {"temperature": 0, "max_tokens": 8, "ignore_eos": True})
        eos = ref[3]
        async with serve(executor, tokenizer, generation_defaults={"eos_token_id": [eos]}) as (c, _):
            stopped = await tokens(c, {"temperature": 0, "max_tokens": 8})
            ignored = await tokens(c, {"temperature": 0, "max_tokens": 8, "ignore_eos": True})
        return ref, eos, stopped, ignored

    ref, eos, stopped, ignored = run(main())
    k = ref.index(eos)
    assert stopped == (ref[:k + 1], "stop") and ignored == (ref, "length")  # the EOS token is counted


def test_chat_needs_a_tokenizer_with_a_template(executor, tokenizer):
    from transformers import AutoTokenizer

    no_template = AutoTokenizer.from_pretrained(tokenizer.name_or_path, local_files_only=True)
    no_template.chat_template = None
    body = {"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 4, "temperature": 0}

    async def main():
        out = {}
        for name, tok in (("template", tokenizer), ("no_template", no_template), ("no_tokenizer", None)):
            async with serve(executor, tok) as (c, _):
                r = await c.post("/v1/chat/completions", json=body)
                out[name] = (r.status, await r.json())
        return out

    out = run(main())
    status, ok = out["template"]
    assert status == 200 and ok["object"] == "chat.completion"
    expected = tokenizer.apply_chat_template(body["messages"], add_generation_prompt=True, tokenize=True,
                                             return_dict=False)
    assert ok["usage"]["prompt_tokens"] == len(expected) and ok["usage"]["completion_tokens"] <= 4
    assert out["no_template"][0] == 400 and out["no_template"][1]["error"]["code"] == "no_chat_template"
    assert out["no_tokenizer"][0] == 400 and out["no_tokenizer"][1]["error"]["code"] == "no_tokenizer"


def test_chat_with_n_seeded_samples_streamed_and_not(executor, tokenizer):
    """n = 3 chat choices (index 0..2): distinct, reproducible, streamed content equal to the whole response, usage
    counting the conversation once and every choice's tokens."""
    import json

    body = {"messages": [{"role": "user", "content": "tell me something"}], "max_completion_tokens": 8,
            "temperature": 1.0, "seed": 99, "n": 3, "ignore_eos": True}

    async def main():
        async with serve(executor, tokenizer) as (c, _):
            whole = [await (await c.post("/v1/chat/completions", json=body)).json() for _ in range(2)]
            r = await c.post("/v1/chat/completions", json={**body, "stream": True})
            streamed: dict[int, str] = {}
            async for raw in r.content:
                line = raw.decode().strip()
                if line.startswith("data: {"):
                    for ch in json.loads(line[6:])["choices"]:
                        streamed[ch["index"]] = streamed.get(ch["index"], "") + ch["delta"].get("content", "")
        return whole, streamed

    whole, streamed = run(main())
    texts = [ch["message"]["content"] for ch in whole[0]["choices"]]
    assert [ch["index"] for ch in whole[0]["choices"]] == [0, 1, 2]
    assert texts == [ch["message"]["content"] for ch in whole[1]["choices"]] and len(set(texts)) == 3
    assert [streamed[i] for i in range(3)] == texts
    expected = tokenizer.apply_chat_template(body["messages"], add_generation_prompt=True, tokenize=True,
                                             return_dict=False)
    assert whole[0]["usage"] | {"prompt_tokens_details": None} == {
        "prompt_tokens_details": None, "prompt_tokens": len(expected), "completion_tokens": 24,
        "total_tokens": len(expected) + 24}


def test_stop_strings_abort_the_request_and_free_its_blocks(executor, tokenizer):
    async def main():
        async with serve(executor, tokenizer) as (c, _):
            ref, _ = await tokens(c, {"temperature": 0, "max_tokens": 40, "ignore_eos": True})
            text = tokenizer.decode(ref)
            stop = text[len(tokenizer.decode(ref[:3])) - 1:][:3]  # straddles the 3rd and 4th tokens
            r = await c.post("/v1/completions", json={"prompt": PROMPT, "temperature": 0, "max_tokens": 40,
                                                      "ignore_eos": True, "stop": stop})
            body = await r.json()
            for _ in range(50):  # the abort reaches the engine thread at the next step boundary
                st = await (await c.get("/status")).json()
                e = st["engine"]  # as the engine thread last published it
                if e["running"] == e["waiting"] == 0 and e["requests_aborted"] >= 1:
                    break
                await asyncio.sleep(0.05)
        return ref, text, stop, body, st

    ref, text, stop, body, st = run(main())
    ch = body["choices"][0]
    assert ch["finish_reason"] == "stop" and ch["text"] == text[:text.index(stop)]
    complete = next(j for j in range(1, len(ref) + 1) if stop in tokenizer.decode(ref[:j]))
    assert ch["token_ids"] == ref[:complete] and body["usage"]["completion_tokens"] == complete < 40
    eng = st["engine"]
    assert eng["requests_aborted"] >= 1 and eng["running"] == 0 and eng["in_flight"] == 0
    assert all(d["free_kv_blocks"] == d["num_kv_blocks"] - 1 for d in eng["dp_ranks"])


ADMIN = "s3cret-token"


def test_admin_requires_the_token_json_and_the_own_origin(executor, tokenizer):
    async def main():
        async with serve(executor, tokenizer, admin_token=ADMIN) as (c, _):
            own = f"http://127.0.0.1:{c.port}"
            good = {"Authorization": f"Bearer {ADMIN}"}

            async def post(headers=None, **kw):
                r = await c.post("/admin/reset", headers=headers, **kw)
                return r.status

            out = {
                "no token": await post(json={}),
                "wrong token": await post({"Authorization": "Bearer nope"}, json={}),
                "token without Bearer": await post({"Authorization": ADMIN}, json={}),
                "text/plain": await post({**good, "Content-Type": "text/plain"}, data="{}"),
                "form": await post(good, data={"recapture": "true"}),
                "no content type": await post(good, data=b"{}", skip_auto_headers=["Content-Type"]),
                "foreign origin": await post({**good, "Origin": "http://evil.example"}, json={}),
                "null origin": await post({**good, "Origin": "null"}, json={}),
                "other port": await post({**good, "Origin": f"http://127.0.0.1:{c.port + 1}"}, json={}),
            }
            before = (await (await c.get("/status")).json())["num_resets"]
            out["good"] = await post(good, json={})
            out["own origin"] = await post({**good, "Origin": own}, json={})
            out["empty body"] = await post({**good, "Content-Type": "application/json"}, data=b"")
            after = (await (await c.get("/status")).json())
        return out, before, after

    out, before, after = run(main())
    assert out["no token"] == out["wrong token"] == out["token without Bearer"] == 401
    assert out["text/plain"] == out["form"] == out["no content type"] == 415
    assert out["foreign origin"] == out["null origin"] == out["other port"] == 403
    assert out["good"] == out["own origin"] == out["empty body"] == 200
    assert after["num_resets"] == before + 3 and after["admin_auth"] is True


def test_without_a_token_admin_needs_a_loopback_host_header(executor, tokenizer):
    async def main():
        async with serve(executor, tokenizer) as (c, _):
            before = (await (await c.get("/status")).json())["num_resets"]
            out = {}
            for host in ("evil.example", f"evil.example:{c.port}", f"127.0.0.1:{c.port}", f"localhost:{c.port}",
                         f"[::1]:{c.port}"):
                r = await c.post("/admin/reset", json={}, headers={"Host": host})
                out[host] = r.status
            st = await (await c.get("/status")).json()
            return c.port, out, st, before

    port, out, st, before = run(main())
    assert out["evil.example"] == out[f"evil.example:{port}"] == 403
    assert out[f"127.0.0.1:{port}"] == out[f"localhost:{port}"] == out[f"[::1]:{port}"] == 200
    assert st["num_resets"] == before + 3 and st["admin_auth"] is False


def test_body_limits_through_the_server(executor, tokenizer):
    from launch.protocol import ProtocolLimits

    async def main():
        async with serve(executor, tokenizer, limits=ProtocolLimits(max_body_bytes=64 * 1024)) as (c, _):
            out = []
            for data in (b"[" * 200_000, b'{"prompt": [' + b"1," * 40_000 + b"1]}", b"[" * 50_000,
                         b'{"prompt": [1], "seed": 1e400}', b'{"prompt": [1], "top_k": 18446744073709551615}'):
                r = await c.post("/v1/completions", data=data, headers={"Content-Type": "application/json"})
                out.append((r.status, (await r.json())["error"]))
            r = await c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "temperature": 0})
            out.append((r.status, None))
        return out

    out = run(main())
    assert [s for s, _ in out] == [413, 413, 400, 400, 400, 200], out
    assert "nested" in out[2][1]["message"] and out[4][1]["param"] == "top_k"


def test_large_texts_are_tokenised_off_the_event_loop(executor, tokenizer):
    """A ~1M-character prompt costs the tokenizer most of a second; a concurrent stream keeps flowing meanwhile."""
    big = "The quick brown fox jumps over the lazy dog. " * 21_000

    async def main():
        async with serve(executor, tokenizer) as (c, _):
            gaps, last = [], None
            big_task = None
            async with c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 100, "temperature": 0,
                                                       "ignore_eos": True, "stream": True}) as r:
                async for line in r.content:
                    now = asyncio.get_running_loop().time()
                    if last is not None and big_task is not None and not big_task.done():
                        gaps.append(now - last)
                    last = now
                    if big_task is None:
                        big_task = asyncio.create_task(c.post("/v1/completions", json={"prompt": big}))
                        t0 = now
            resp = await big_task
            return gaps, resp.status, (await resp.json())["error"]["code"], asyncio.get_running_loop().time() - t0

    gaps, status, code, took = run(main())
    assert status == 400 and code == "context_length_exceeded"  # tokenised, then refused by length
    assert len(gaps) >= 5, (gaps, took)  # the stream went on while the big prompt was tokenised
    assert max(gaps) < 0.3, (max(gaps), took)


@pytest.mark.parametrize("stream", [True, False])
def test_a_stop_string_aborts_its_prompt_while_the_others_go_on(executor, tokenizer, stream):
    """Two prompts in one request: the one a stop string ends leaves the engine at once, not when the response
    ends (the other keeps generating meanwhile)."""
    other = [5, 6, 7, 8]

    async def main():
        async with serve(executor, tokenizer) as (c, _):
            ref, _ = await tokens(c, {"temperature": 0, "max_tokens": 8, "ignore_eos": True})
            r = await c.post("/v1/completions", json={"prompt": other, "temperature": 0, "max_tokens": 100,
                                                      "ignore_eos": True})
            other_text = (await r.json())["choices"][0]["text"]
            stop = next(t for t in (tokenizer.decode(ref[:k])[-2:] for k in range(3, 8)) if t not in other_text)
            body = {"prompt": [PROMPT, other], "max_tokens": 100, "temperature": 0, "ignore_eos": True, "stop": stop,
                    "stream": stream}
            before = (await (await c.get("/status")).json())["engine"]["generated_tokens"]
            running_after_stop = None
            async with c.post("/v1/completions", json=body) as r:
                if stream:
                    async for line in r.content:
                        line = line.decode().strip()
                        if running_after_stop is None and '"finish_reason": "stop"' in line:
                            for _ in range(40):
                                running_after_stop = (await (await c.get("/status")).json())["engine"]["running"]
                                if running_after_stop <= 1:
                                    break
                                await asyncio.sleep(0.05)
                            still_streaming = True
                    final = None
                else:
                    still_streaming = False
                    final = await r.json()
            for _ in range(40):
                st = await (await c.get("/status")).json()
                if st["engine"]["running"] == 0:
                    break
                await asyncio.sleep(0.05)
            return running_after_stop, still_streaming, final, st, before

    running_after_stop, still_streaming, final, st, before = run(main())
    if stream:
        assert running_after_stop == 1 and still_streaming  # the other prompt still runs; the stopped one is gone
    else:
        assert [ch["finish_reason"] for ch in final["choices"]] == ["stop", "length"]
        assert len(final["choices"][1]["token_ids"]) == 100 and len(final["choices"][0]["token_ids"]) <= 4
    assert st["engine"]["requests_aborted"] >= 1
    assert st["engine"]["generated_tokens"] - before < 100 + 20  # the stopped prompt did not run on to max_tokens
