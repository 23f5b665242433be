"""The chat side of `graphline bench` (`--api chat`, `--api responses`, `--api completions,chat,responses`):
conversations of about `--prompt-len` tokens, the streamed `/v1/chat/completions` and `/v1/responses` clients, and
their ratios to completions.

Prompts: a fixed system message and a user message of random words, cut so that the conversation through the
checkpoint's chat template (`apply_chat_template`, the call `launch.chat.render_chat` makes on the server) is at
most `--prompt-len` tokens. Side by side, the completions run sends such templated conversations as token ids
(the same construction and length, other random words: one shared prompt would be a prefix-cache hit for the API
that runs second), so both APIs prefill the same number of tokens and, with `ignore_eos`, generate the same
`--max-tokens`; what differs is the chat path: the template, a stop string (`CHAT_STOP`, which never occurs, so
every token goes through the stop-string matcher) and the chat chunk shape.

Chat chunks carry text, not token ids: a chat request's token count is its `usage` (`stream_options.include_usage`),
its first token time the first event with content (the role-only opening event is sent before any token), and its
TPOT (last event - first event) / (tokens - 1), as for completions. A token that brings no text (a special token,
part of a UTF-8 character) sends no chat event: when the first tokens are such, the first event is late and the
TPOT low by their share of the tokens (1/127 each at 128 tokens; none for the text tokens of a trained model).
"""
from __future__ import annotations

import json
import time
from typing import Any, Optional

SYSTEM = "You are a helpful assistant."
CHAT_STOP = "\u241e graphline bench: a stop string that never occurs \u241e"
WORDS = tuple(
    "the of and to in is that for it as was with be by on not he this are or his from at which but have an they "
    "you were her she there would their we him been has when who will more no if out so said what up its about "
    "into than them can only other new some could time these two may then do first any my now such like our over "
    "man me even most made after also did many before must through back years where much your way well down "
    "should because each just those people how too little state good very make world still own see men work long "
    "get here between both life being under never day same another know while last might us great old year off "
    "come since against go came right used take three graph token model cache batch kernel stream server answer "
    "question request memory device engine decode prefill attention layer weight block".split())


def timings(t0: float, times: list[float], ntok: int, t_end: float) -> dict:
    """One request's TTFT, TPOT and event gaps from its start `t0` and the arrival times of its events."""
    first = times[0] if times else t_end
    tpot = (times[-1] - first) / (ntok - 1) if ntok > 1 and times else None
    return {"ttft": first - t0, "tpot": tpot, "tokens": ntok, "latency": t_end - t0,
            "gaps": [b - a for a, b in zip(times, times[1:])], "events": len(times), "arrivals": [t0, *times]}


def load_bench_tokenizer(path: Optional[str]) -> Any:
    """The served checkpoint's tokenizer (`--tokenizer`, else `--model` when it is a directory); a LaunchError
    when there is none (chat prompts are built, and measured, with its template)."""
    from launch.options import LaunchError, load_tokenizer

    tok = load_tokenizer(path) if path else None
    if tok is None or not getattr(tok, "chat_template", None):
        raise LaunchError(f"--api chat needs the served checkpoint's tokenizer with a chat template; {path!r} has "
                          "none: pass --tokenizer CHECKPOINT_DIR (or --model CHECKPOINT_DIR)")
    return tok


class ChatPrompts:
    """Random conversations of at most `prompt_len` tokens through the tokenizer's chat template."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self._cost = {w: len(tokenizer.encode(" " + w, add_special_tokens=False)) for w in WORDS}

    def render(self, messages: list[dict]) -> list[int]:
        from launch.chat import render_chat

        return render_chat(self.tokenizer, messages, True, False, {})

    def make(self, rng, prompt_len: int) -> tuple[list[dict], list[int]]:
        """(messages, their templated token ids): the user words are drawn by `rng` (numpy Generator)."""
        def conv(words: list[str]) -> list[dict]:
            return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": " ".join(words)}]

        budget = prompt_len - len(self.render(conv(["question"])))
        words: list[str] = [WORDS[int(rng.integers(len(WORDS)))]]
        used = self._cost[words[0]]
        while used < budget:
            w = WORDS[int(rng.integers(len(WORDS)))]
            words.append(w)
            used += self._cost[w]
        ids = self.render(conv(words))
        while len(ids) > prompt_len and len(words) > 1:
            words.pop()
            ids = self.render(conv(words))
        return conv(words), ids


async def stream_events(session, url: str, body: dict):
    """POST `body` (a streaming request) to `url` and yield each server-sent event's JSON payload up to
    `[DONE]`; raises RuntimeError on an HTTP error status or an error event."""
    async with session.post(url, json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {await resp.text()}")
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            if chunk.get("type") == "error":  # a Responses API error event
                raise RuntimeError(chunk["message"])
            yield chunk


async def one_chat_request(session, url: str, model: Optional[str], messages: list[dict], max_tokens: int,
                           sampling: dict) -> dict:
    """One streamed chat completion with the never-matching stop string; raises on an HTTP error or an error
    event. Returns what `launch.bench.one_request` does, plus `prompt_tokens` (the server's usage)."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, **sampling, "stop": [CHAT_STOP],
            "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    times, usage = [], None
    async for chunk in stream_events(session, f"{url}/v1/chat/completions", body):
        usage = chunk.get("usage") or usage
        for ch in chunk["choices"]:
            if ch["delta"].get("content") or ch.get("finish_reason"):
                times.append(time.perf_counter())
    t_end = time.perf_counter()
    if usage is None:
        raise RuntimeError("the stream ended without a usage chunk")
    return {**timings(t0, times, usage["completion_tokens"], t_end), "prompt_tokens": usage["prompt_tokens"]}


async def one_responses_request(session, url: str, model: Optional[str], messages: list[dict], max_tokens: int,
                                sampling: dict) -> dict:
    """`one_chat_request` through `/v1/responses` (the messages as `input`; `response_format` as `text.format`):
    its events with text, then the final event, are the token arrivals; the final object's usage the counts."""
    sampling = dict(sampling)
    fmt = sampling.pop("response_format", None)
    body = {"model": model, "input": messages, "max_output_tokens": max_tokens, **sampling, "stop": [CHAT_STOP],
            "stream": True, **({"text": {"format": fmt}} if fmt else {})}
    t0 = time.perf_counter()
    times, usage = [], None
    async for event in stream_events(session, f"{url}/v1/responses", body):
        if event["type"] == "response.output_text.delta":
            times.append(time.perf_counter())
        elif event["type"] in ("response.completed", "response.incomplete"):
            times.append(time.perf_counter())
            usage = event["response"]["usage"]
    t_end = time.perf_counter()
    if usage is None:
        raise RuntimeError("the stream ended without a final response event")
    return {**timings(t0, times, usage["output_tokens"], t_end), "prompt_tokens": usage["input_tokens"]}


def ratios(levels: list[dict], api: str = "chat") -> list[dict]:
    """Per concurrency with both APIs: `api` / completions of TPOT (median, mean, p99), TTFT median and
    throughput."""
    by = {(lv["clients"], lv.get("api", "completions")): lv for lv in levels}
    out = []
    for c in dict.fromkeys(lv["clients"] for lv in levels):
        chat, comp = by.get((c, api)), by.get((c, "completions"))
        if chat is None or comp is None:
            continue

        def r(key: str, chat: dict = chat, comp: dict = comp) -> Optional[float]:
            a, b = chat.get(key), comp.get(key)
            return a / b if a is not None and b else None

        out.append({"clients": c, "tpot_median_ratio": r("tpot_ms_median"), "tpot_mean_ratio": r("tpot_ms_mean"),
                    "tpot_p99_ratio": r("tpot_ms_p99"), "ttft_median_ratio": r("ttft_ms_median"),
                    "throughput_ratio": r("throughput_tok_s")})
    return out


def print_ratios(rows: list[dict], api: str = "chat") -> None:
    if not rows:
        return
    f = lambda v: f"{v:>10.3f}" if v is not None else f"{'-':>10}"  # noqa: E731
    print(f"{api} / completions (same server; same prompt length and output tokens; {api} adds the template, a stop "
          "string and its events):")
    hdr = f"{'clients':>7} {'TPOT med':>10} {'TPOT mean':>10} {'TPOT p99':>10} {'TTFT med':>10} {'tok/s':>10}"
    print(hdr)
    print("-" * len(hdr))
    for row in rows:
        print(f"{row['clients']:>7} {f(row['tpot_median_ratio'])} {f(row['tpot_mean_ratio'])} "
              f"{f(row['tpot_p99_ratio'])} {f(row['ttft_median_ratio'])} {f(row['throughput_ratio'])}")
