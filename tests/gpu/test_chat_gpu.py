"""Chat on one GPU: the real-format Qwen3 chat fixture (`tests.fixtures.hf_checkpoints`: saved by transformers, a
trained BPE tokenizer, a chat template, a multi-element `eos_token_id`) served by `graphline serve --device cuda`
twice, with CUDA graphs (full decode graphs, piecewise prefill plans) and with `--eager`, asked the same requests
in the same order:

- greedy chat answers (system + user messages, several prompts, `max_tokens` 24), streamed and not, one of them
  with a stop string taken from its own answer, are identical between graphs and eager, and streamed == not
  streamed;
- a completion of the same templated token ids returns the same text, and its token ids (streamed and not) are
  identical between graphs and eager;
- the same chats sent all at once (batched decode, other graph buckets) answer as they did one at a time;
- the graph server served decode with full graphs and prefill with piecewise plans (`/status`), the eager one
  with neither.

dtype: the fixture's config.json says float32, which is what serve runs (only a config without `torch_dtype` gets
bfloat16); it is pinned with `--dtype float32` because bucket padding changes GEMM shapes, and in bf16 that rounding
noise flips greedy choices at the near-ties of random weights (as in tests/gpu/test_model_graphs.py).

HTTP through urllib (no client package). The server needs transformers (tokenizer, chat template) and jinja2.
"""
from __future__ import annotations

import json
import sys
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
from e2e_support import ARTIFACTS, graphline, start_server  # noqa: E402

pytestmark = pytest.mark.gpu

SERVE_ARGS = ["--device", "cuda", "--dtype", "float32", "--max-model-len", "256", "--num-kv-blocks", "128",
              "--max-decode-batch", "16", "--pcg-max-tokens", "256", "--pcg-token-stride", "128", "--no-progress",
              "--port", "0"]
MAX_TOKENS = 24
SYSTEM = "You answer briefly."
USERS = [
    "hello there",
    "What does a paged key-value cache keep in fixed blocks?",
    "Le café est très bon. 日本語のテキスト. Explain graphs and piecewise prefill in one sentence.",
    " ".join(["Every request is split into tokens, and the scheduler batches the tokens of many requests."] * 5),
]
IGNORE_EOS = [True, True, True, False]  # the last one may end at one of generation_config.json's EOS ids


def _messages(user: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]


def _post(url: str, path: str, body: dict):
    """The JSON response, or for `stream` the list of event payloads (data lines before [DONE])."""
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=180) as r:
        assert r.status == 200, r.read()[:2000]
        if not body.get("stream"):
            return json.loads(r.read())
        events = []
        for raw in r:
            line = raw.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
        assert all("error" not in e for e in events), events
        return events


def _get(url: str, path: str) -> dict:
    with urllib.request.urlopen(url + path, timeout=60) as r:
        return json.loads(r.read())


def _chat(url: str, i: int, stream: bool, stop: str | None = None) -> dict:
    body = {"messages": _messages(USERS[i]), "max_tokens": MAX_TOKENS, "temperature": 0, "stream": stream,
            "ignore_eos": IGNORE_EOS[i]}
    if stop is not None:
        body["stop"] = [stop]
    if stream:
        body["stream_options"] = {"include_usage": True}
    out = _post(url, "/v1/chat/completions", body)
    if not stream:
        ch = out["choices"][0]
        return {"text": ch["message"]["content"], "finish_reason": ch["finish_reason"],
                "tokens": out["usage"]["completion_tokens"]}
    deltas = [ch for e in out for ch in e["choices"]]
    assert deltas and deltas[0]["delta"].get("role") == "assistant", deltas[:2]
    usage = [e["usage"] for e in out if e.get("usage")]
    return {"text": "".join(ch["delta"].get("content") or "" for ch in deltas),
            "finish_reason": [ch["finish_reason"] for ch in deltas if ch["finish_reason"]][-1],
            "tokens": usage[-1]["completion_tokens"]}


def _complete(url: str, ids: list[int], i: int, stream: bool) -> dict:
    body = {"prompt": ids, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": stream, "ignore_eos": IGNORE_EOS[i]}
    out = _post(url, "/v1/completions", body)
    chs = [out["choices"][0]] if not stream else [ch for e in out for ch in e["choices"]]
    return {"text": "".join(ch["text"] for ch in chs), "token_ids": [t for ch in chs for t in ch["token_ids"]],
            "finish_reason": [ch["finish_reason"] for ch in chs if ch["finish_reason"]][-1]}


def _pick_stop(text: str) -> str:
    """Three printable ASCII characters from inside `text`, from a third of the way on where there are (random
    weights also emit byte tokens that decode to U+FFFD); its first occurrence ends the stopped answer."""
    windows = [text[i:i + 3] for i in range(1, len(text) - 2)]
    plain = [w for w in windows if w.isascii() and w.isprintable()]
    later = [w for w in plain if text.index(w) >= len(text) // 3]
    assert windows, f"the greedy answer is too short to take a stop string from: {text!r}"
    return (later or plain or windows)[0]


def collect(url: str, templated: list[list[int]], stop: str | None = None) -> dict:
    """Every request, one at a time then the chats all at once; `stop` None: taken from the first answer."""
    out: dict = {"chat": [], "chat_stream": [], "completion": [], "completion_stream": []}
    for i, ids in enumerate(templated):
        out["chat_stream"].append(_chat(url, i, True))
        out["chat"].append(_chat(url, i, False))
        out["completion"].append(_complete(url, ids, i, False))
        out["completion_stream"].append(_complete(url, ids, i, True))
    out["stop"] = stop = _pick_stop(out["chat_stream"][0]["text"]) if stop is None else stop
    out["stopped_stream"] = _chat(url, 0, True, stop)
    out["stopped"] = _chat(url, 0, False, stop)
    with ThreadPoolExecutor(len(USERS)) as pool:
        out["chat_batched"] = list(pool.map(lambda i: _chat(url, i, True), range(len(USERS))))
    out["status"] = _get(url, "/status")
    return out


def check_one_server(got: dict, templated: list[list[int]]) -> None:
    """What holds within one server: streamed == not, chat == a completion of the templated ids, the stop."""
    for i in range(len(templated)):
        chat, comp = got["chat_stream"][i], got["completion"][i]
        assert chat == got["chat"][i], (i, chat, got["chat"][i])
        assert got["completion_stream"][i] == comp, (i, got["completion_stream"][i], comp)
        assert chat["text"] == comp["text"] and chat["tokens"] == len(comp["token_ids"]), (i, chat, comp)
        if IGNORE_EOS[i]:
            assert chat["tokens"] == MAX_TOKENS and chat["finish_reason"] == "length", (i, chat)
    full, stop = got["chat_stream"][0]["text"], got["stop"]
    want = full[:full.index(stop)]
    for s in (got["stopped_stream"], got["stopped"]):
        assert s["text"] == want and s["finish_reason"] == "stop", (stop, want, s)
    assert got["chat_batched"] == got["chat_stream"], "chats sent at once answered otherwise than one at a time"


def _serve_and_collect(ckpt: Path, templated: list[list[int]], eager: bool, stop: str | None = None) -> dict:
    srv = start_server(graphline("serve", "--model", str(ckpt), *SERVE_ARGS, *(["--eager"] if eager else [])),
                       timeout=600)
    try:
        return collect(srv.url, templated, stop)
    finally:
        srv.stop()
        ARTIFACTS.mkdir(exist_ok=True)
        (ARTIFACTS / f"gpu-chat-{'eager' if eager else 'graphs'}.log").write_text(srv.output())


@pytest.fixture(scope="module")
def fixture_checkpoint(tmp_path_factory):
    transformers = pytest.importorskip("transformers", reason="the chat fixture and the server's tokenizer need "
                                       "transformers, tokenizers and jinja2 (pip install transformers jinja2)")
    pytest.importorskip("tokenizers", reason="the fixture trains its tokenizer with `tokenizers`")
    from tests.fixtures.hf_checkpoints import build_checkpoint

    d = build_checkpoint(tmp_path_factory.mktemp("chat-gpu") / "qwen3-chat-fixture")
    tok = transformers.AutoTokenizer.from_pretrained(str(d), local_files_only=True)
    templated = []
    for user in USERS:
        ids = tok.apply_chat_template(_messages(user), add_generation_prompt=True, tokenize=True)
        templated.append([int(t) for t in (ids["input_ids"] if hasattr(ids, "keys") else ids)])
    assert max(len(t) for t in templated) + MAX_TOKENS <= 256 and max(len(t) for t in templated) > 128
    return d, templated


def test_chat_with_cuda_graphs_answers_as_eager(fixture_checkpoint):
    ckpt, templated = fixture_checkpoint
    graphs = _serve_and_collect(ckpt, templated, eager=False)
    eager = _serve_and_collect(ckpt, templated, eager=True, stop=graphs["stop"])
    for got in (graphs, eager):
        check_one_server(got, templated)
    for key in ("chat_stream", "chat", "completion", "completion_stream", "stopped_stream", "stopped"):
        assert graphs[key] == eager[key], (key, graphs[key], eager[key])
    for r in graphs["status"]["ranks"]:
        assert r["capture"]["decode_graphs"] > 0 and r["capture"]["prefill_plans"] > 0, r["capture"]
        assert r["steps"].get("full_graph", 0) > 0, r["steps"]  # decode served by full CUDA graphs
        assert r["steps"].get("prefill_graph", 0) > 0, r["steps"]  # prefill served by full prefill graphs
    for r in eager["status"]["ranks"]:
        assert not any(r["steps"].get(k) for k in ("full_graph", "prefill_graph", "piecewise")), r["steps"]
    print(f"stop string {graphs['stop']!r}; graph server steps {[r['steps'] for r in graphs['status']['ranks']]}; "
          f"answers {[c['text'] for c in graphs['chat_stream']]}")
