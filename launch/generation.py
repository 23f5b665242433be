"""Generation over HTTP: one engine request per choice (n per prompt: the samples of a prompt share its KV blocks,
`engine.samples`), their outputs turned into OpenAI choices as tokens arrive (`launch.outputs.ChoiceState`: text,
stop strings, counts), answered whole or streamed as server-sent events. A choice ended by a stop string aborts
its engine request; so does a client that goes away."""
from __future__ import annotations

import asyncio
import json
import sys
import traceback
import uuid
from typing import Any, Callable, Optional

from aiohttp import web

from engine.async_engine import AsyncLLMEngine
from launch.chat import chat_delta, chat_response
from launch.logprobs import chat_logprobs, completion_logprobs
from launch.outputs import ChoiceState
from launch.prompt_logprobs import echo_logprobs, echo_text, vllm_prompt_logprobs
from launch.completions import choice, completion_response
from launch.protocol import ApiError, GenerationRequest, TextOptions, choices_usage, now_s, stream_chunk
from launch.reasoning import ThinkTags, splitter_for
from launch.structured import gate_for_reasoning
from launch.forced_tools import ForcedCallStream, forced_answer
from launch.tools import ToolCallStream, ToolChoice, extract_tool_calls

ENGINE_FAILED = "the engine failed while serving this request; retry it"


def log_failure(what: str, exc: BaseException) -> str:
    """Log an engine/handler failure on the server side; the client gets a reference, never the details."""
    ref = uuid.uuid4().hex[:12]
    print(f"graphline: {what} [{ref}]: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
    if what == "handler error":
        traceback.print_exception(exc, file=sys.stderr)
    return ref


class Shape:
    """How choices look on the wire for one endpoint."""

    def __init__(self, chat: bool, tokenizer: Any = None, think_tags: Optional[ThinkTags] = None,
                 tool_choice: Optional[ToolChoice] = None):
        """`think_tags`: chat with a reasoning parser (`launch.reasoning`): the think block is returned apart.
        `tool_choice`: how the text becomes tool calls ("auto": `launch.tools`' parser; forced:
        `launch.forced_tools`); one Shape serves one request."""
        self.chat = chat
        self.tokenizer = tokenizer
        self.think_tags = think_tags if chat else None
        self.tool_choice = tool_choice if chat and tool_choice is not None and tool_choice.mode != "none" else None
        self._tool_streams: dict[int, Any] = {}  # per choice: a ToolCallStream ("auto") or a ForcedCallStream
        self.object = "chat.completion.chunk" if chat else "text_completion"
        self.greq: Optional[GenerationRequest] = None  # `bind`: the request's prompts
        self.text = TextOptions()  # `bind`: the request's (echo, prompt_logprobs, token ids ...)
        self.lp_tokenizer = tokenizer  # what writes logprob tokens (None: `token_id:<id>`)

    def bind(self, greq: GenerationRequest) -> None:
        """The request this shape answers (its prompts, for `echo`, `prompt_logprobs` and `return_token_ids`;
        `return_tokens_as_token_ids`: every logprob token is written `token_id:<id>`, as without a tokenizer)."""
        self.greq, self.text = greq, greq.text
        if greq.text.tokens_as_ids:
            self.lp_tokenizer = None

    def _prompt(self, c: ChoiceState) -> list[int]:
        return self.greq.prompts[c.index // self.greq.n]

    def _echoed(self, c: ChoiceState, text: str, lp: Optional[dict], tokens: list[int]) -> tuple[str, Optional[dict]]:
        """A completions choice's text and logprobs with its prompt in front (`echo`)."""
        prompt = self._prompt(c)
        lp = None if c.logprobs is None else echo_logprobs(self.lp_tokenizer, prompt, c.prompt_lp,
                                                           lp if tokens else None)
        return echo_text(self.tokenizer, prompt) + text, lp

    def opening(self, c: ChoiceState) -> Optional[dict]:
        """A streamed chat choice's first delta: the role (and the echoed last message, chat's `echo`)."""
        return chat_delta(c.index, self.text.chat_echo, None, first=True) if self.chat else None

    def _logprobs(self, c: ChoiceState, tokens: list[int], entries: list, text_start: int) -> Optional[dict]:
        if c.logprobs is None:
            return None
        if self.chat:
            return chat_logprobs(self.lp_tokenizer, tokens, entries)
        return completion_logprobs(self.lp_tokenizer, tokens, entries, text_start)

    def delta(self, c: ChoiceState, text: str, tokens: list[int]) -> Optional[dict]:
        reason = c.finish_reason if c.done else None
        lp = self._logprobs(c, tokens, c.last_logprobs, c.last_text_start) if tokens else None
        if self.chat:
            r, calls = c.last_reasoning, None
            if self.tool_choice is not None:
                text, calls, reason = self._tools_delta(c, text, reason)
            want_ids = self.text.return_token_ids
            if not (text or r or reason or lp or calls or (want_ids and tokens)):
                return None
            out = chat_delta(c.index, text, reason, logprobs=lp, reasoning=r, tool_calls=calls)
            if want_ids:
                out["token_ids"] = tokens
            return out
        prompt_lp = ids = None
        if not c.first_sent and (text or tokens or reason):
            c.first_sent = True  # the first chunk carries the prompt's echo and its prompt_logprobs
            if self.text.echo:
                text, lp = self._echoed(c, text, lp, tokens)
            if self.text.prompt_logprobs:
                prompt_lp = vllm_prompt_logprobs(self.lp_tokenizer, self._prompt(c), c.prompt_lp)
            if self.text.return_token_ids:
                ids = self._prompt(c)
        if not (text or tokens or reason):
            return None
        ch = choice(c.index, text, tokens, reason, lp)
        if prompt_lp is not None:
            ch["prompt_logprobs"] = prompt_lp
        if ids is not None:
            ch["prompt_token_ids"] = ids
        return ch

    def _tools_delta(self, c: ChoiceState, text: str,
                     reason: Optional[str]) -> tuple[str, Optional[list], Optional[str]]:
        """The content a streamed chat choice sends now, the tool calls completed, its finish reason."""
        tc = self.tool_choice
        if tc.forced:
            fst = self._tool_streams.setdefault(c.index, ForcedCallStream(tc))
            return "", fst.push(text) or None, fst.finish_reason(reason)
        st = self._tool_streams.setdefault(c.index, ToolCallStream())
        text, new = st.push(text)
        if c.done:
            text += st.finish()
        first = len(st.calls) - len(new)
        if not tc.parallel:
            new = new[:max(0, 1 - first)]
        calls = [{"index": first + k, **call} for k, call in enumerate(new)] or None
        return text, calls, "tool_calls" if reason == "stop" and st.calls else reason

    def _tool_answer(self, c: ChoiceState) -> tuple[Optional[str], list[dict], Optional[str]]:
        """(content, tool calls, finish reason) of a whole chat choice."""
        tc = self.tool_choice
        if tc.forced:
            return forced_answer(c.text, c.finish_reason, tc)
        content, calls = extract_tool_calls(c.text)
        calls = calls if tc.parallel else calls[:1]
        return content, calls, "tool_calls" if calls and c.finish_reason == "stop" else c.finish_reason

    def writer(self, resp: web.StreamResponse, rid: str, greq: GenerationRequest, created: int,
               choices: list[ChoiceState]) -> "_ChunkWriter":
        """The writer of a streamed response's events (`start`, `choices`, `error`, `close`)."""
        usage_of = (lambda: choices_usage(choices, greq.n)) if greq.text.continuous_usage else None
        return _ChunkWriter(resp, rid, greq.model, created, self.object, usage_of, greq.include_usage)

    def response(self, rid: str, model: str, created: int, choices: list[ChoiceState], n: int) -> dict:
        lps = [self._logprobs(c, c.token_ids, c.logprobs or [], 0) for c in choices]
        tools = [self._tool_answer(c) for c in choices] if self.tool_choice is not None else None
        if self.chat:
            out = chat_response(rid, model, created, choices, lps, self.think_tags is not None, tools)
            text = self.text
            if text.chat_echo:
                for ch in out["choices"]:
                    ch["message"]["content"] = text.chat_echo + (ch["message"]["content"] or "")
            if text.prompt_logprobs:
                out["prompt_logprobs"] = vllm_prompt_logprobs(self.lp_tokenizer, self._prompt(choices[0]),
                                                              choices[0].prompt_lp)
            if text.return_token_ids:
                out["prompt_token_ids"] = self._prompt(choices[0])
                for c, ch in zip(choices, out["choices"]):
                    ch["token_ids"] = c.token_ids
            return out
        out = completion_response(rid, model, created, choices, n, lps)
        text = self.text
        for c, ch in zip(choices, out["choices"]):
            if text.echo:
                ch["text"], ch["logprobs"] = self._echoed(c, ch["text"], ch["logprobs"], c.token_ids)
            if text.prompt_logprobs:
                ch["prompt_logprobs"] = vllm_prompt_logprobs(self.lp_tokenizer, self._prompt(c), c.prompt_lp)
            if text.return_token_ids:
                ch["prompt_token_ids"] = self._prompt(c)
        return out




def _feed(c: ChoiceState, outs: list) -> tuple[str, list[int]]:
    new = outs[0].new_token_ids if len(outs) == 1 else [t for o in outs for t in o.new_token_ids]
    last = outs[-1]
    c.cached_tokens = last.num_cached_tokens
    if outs[0].prompt_logprobs is not None:
        c.prompt_lp = outs[0].prompt_logprobs
    if c.echo_only:  # `max_tokens: 0`: the prompt alone
        return c.feed([], last.finished, "length" if last.finished else None,
                      new_logprobs=None if last.new_logprobs is None else [])
    lps = None if last.new_logprobs is None else [e for o in outs for e in (o.new_logprobs or ())]
    return c.feed(new, last.finished, last.finish_reason.value if last.finished and last.finish_reason else None,
                  stop_token=last.stopped_on_token, new_logprobs=lps)


async def generate(request: web.Request, eng: AsyncLLMEngine, tokenizer: Any, greq: GenerationRequest, rid: str,
                   shape: Shape) -> web.StreamResponse:
    """Submit one request per choice (n per prompt) and answer with the finished choices, or stream them (SSE)."""
    reqs = [r for p, mt in zip(greq.prompts, greq.max_tokens)
            for r in eng.make_samples(eng.make_request(p, greq.sampling, mt, greq.stop_token_ids,
                                                       grammar=gate_for_reasoning(greq.grammar, shape.think_tags, p),
                                                       priority=greq.priority),
                                      greq.n, fit_max_tokens=not greq.max_tokens_given)]
    eng.admit(len(reqs))  # EngineBusyError (429) before anything is queued
    shape.bind(greq)
    choices = [ChoiceState(i, len(greq.prompts[i // greq.n]), tokenizer, greq.stop, keep_logprobs=not greq.stream,
                           think=splitter_for(shape.think_tags, greq.prompts[i // greq.n]),
                           include_stop=greq.text.include_stop_str, skip_special_tokens=greq.text.skip_special_tokens)
               for i in range(len(reqs))]
    for c in choices:
        c.echo_only = greq.text.echo_only
    created = now_s()
    if greq.stream:
        return await _stream(request, eng, greq, reqs, choices, rid, created, shape)
    streams = []
    try:
        for r in reqs:
            streams.append(eng.submit(r))
        await asyncio.gather(*[_consume(eng, s, c) for s, c in zip(streams, choices)])
    finally:
        for s in streams:
            if not s.finished:
                eng.abort(s.request_id)  # a stop string matched (or the client left): free its blocks
    return web.json_response(shape.response(rid, greq.model, created, choices, greq.n))


async def _consume(eng: AsyncLLMEngine, stream, c: ChoiceState) -> None:
    async for first in stream:
        _feed(c, [first, *stream.drain_nowait()])
        if c.done:
            if not stream.finished:
                eng.abort(stream.request_id)  # a stop string matched: free its blocks now
            return


class _ChunkWriter:
    """Server-sent chunks of one response: the envelope (id, object, created, model) is serialised once;
    each event serialises only its choices. `usage_of`: `stream_options.continuous_usage_stats`, the usage so far
    that every chunk with choices carries."""

    def __init__(self, resp: web.StreamResponse, rid: str, model: str, created: int, object_: str,
                 usage_of: Optional[Callable[[], dict]] = None, include_usage: bool = False):
        self.resp = resp
        self.usage_of = usage_of
        self.include_usage = include_usage
        head = json.dumps(stream_chunk(rid, model, created, [], object_=object_))
        self._head = "data: " + head[: head.rindex('"choices": []')] + '"choices": ['

    async def choices(self, choices: list[dict], usage_: Optional[dict] = None) -> None:
        if usage_ is None and choices and self.usage_of is not None:
            usage_ = self.usage_of()
        tail = "]" if usage_ is None else '], "usage": ' + json.dumps(usage_)
        await self.resp.write((self._head + ", ".join(json.dumps(c) for c in choices) + tail + "}\n\n").encode())

    async def start(self, openings: list[dict]) -> None:
        if openings:
            await self.choices(openings)

    async def error(self, exc: BaseException) -> None:
        log_failure("stream failed", exc)
        err = ApiError(503, ENGINE_FAILED, None, "engine_failed", "server_error").body()
        await self.resp.write(f"data: {json.dumps(err)}\n\n".encode())

    async def close(self, usage_: dict) -> None:
        """`usage_`: of the finished choices (sent when `stream_options.include_usage` asked)."""
        if self.include_usage:
            await self.choices([], usage_)
        await self.resp.write(b"data: [DONE]\n\n")
        await self.resp.write_eof()


async def _stream(request: web.Request, eng: AsyncLLMEngine, greq: GenerationRequest, reqs,
                  choices: list[ChoiceState], rid: str, created: int, shape: Shape) -> web.StreamResponse:
    # validated already: submit only fails if the engine is dead. The engine thread is woken once this handler's
    # own work is done (the response prepared), so that it runs to the model step without waiting for the GIL.
    streams = []
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                       "X-Accel-Buffering": "no"})
    try:
        for r in reqs:
            streams.append(eng.submit(r, wake=False))
        await resp.prepare(request)
        out = shape.writer(resp, rid, greq, created, choices)
        eng.wake()
        await out.start([o for o in (shape.opening(c) for c in choices) if o is not None])
        if len(streams) == 1:  # the common case: read the request's stream directly, one task, no fan-in queue
            c, stream = choices[0], streams[0]
            try:
                async for first in stream:
                    ch = shape.delta(c, *_feed(c, [first, *stream.drain_nowait()]))
                    if ch is not None:
                        await out.choices([ch])
                    if c.done:
                        break
            except Exception as exc:  # noqa: BLE001 - reported in-band
                await out.error(exc)
        else:
            await _stream_many(eng, streams, choices, shape, out)
        await out.close(choices_usage([c for c in choices if c.done], greq.n))
    finally:
        for s in streams:
            if not s.finished:
                eng.abort(s.request_id)
    return resp


async def _stream_many(eng: AsyncLLMEngine, streams, choices: list[ChoiceState], shape: Shape,
                       out: _ChunkWriter) -> None:
    """Several prompts in one request: their streams fan in to one queue, chunks go out as they come."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, stream) -> None:
        try:
            async for first in stream:
                queue.put_nowait((index, first, stream.drain_nowait()))
        except Exception as exc:  # noqa: BLE001 - reported in-band
            queue.put_nowait((index, exc, []))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            index, first, more = await queue.get()
            c = choices[index]
            if c.done:
                continue  # ended by a stop string (its request is aborted)
            if isinstance(first, Exception):
                await out.error(first)
                remaining -= 1
                continue
            ch = shape.delta(c, *_feed(c, [first, *more]))
            if ch is not None:
                await out.choices([ch])
            if c.done:
                remaining -= 1
                if not streams[index].finished:
                    eng.abort(streams[index].request_id)  # a stop string matched: free its blocks now
    finally:
        for t in tasks:
            t.cancel()
