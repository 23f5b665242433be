"""One choice of a response as its tokens arrive: detokenised text, stop strings, the token count.

`ChoiceState.feed(new_token_ids, finished, finish_reason)` returns the text and tokens to send for
this update. With stop strings the tokens are taken one at a time, so that a match ends the choice
exactly at the token that completed it: later tokens (already generated, e.g. by multi-step decode)
are dropped, `token_ids` and `usage.completion_tokens` count up to that token, `finish_reason` is
"stop", and `stopped_early` tells the caller to abort the request in the engine. A request the engine
finished on a stop token (EOS, `stop_token_ids`) keeps that token in `token_ids` and the count, as OpenAI
and vLLM do, but its text is not returned.

With a `launch.reasoning.ThinkSplitter` (chat with `--reasoning-parser`) the tokens inside the think block go to a
second detokenizer: `reasoning_text` (and each feed's `last_reasoning`) holds their text, `text` the content's.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

from launch.detokenizer import IncrementalDetokenizer
from launch.reasoning import ThinkSplitter
from launch.stop_strings import StopStringMatcher


class ChoiceState:
    __slots__ = ("index", "num_prompt_tokens", "detok", "stop", "token_ids", "texts", "finish_reason", "done",
                 "stopped_early", "logprobs", "last_logprobs", "_lp_queue", "text_len", "last_text_start",
                 "_keep_logprobs", "think", "rdetok", "reasoning_texts", "last_reasoning", "reasoning_tokens",
                 "cached_tokens", "prompt_lp", "first_sent", "echo_only")

    def __init__(self, index: int, num_prompt_tokens: int, tokenizer: Any = None, stop: Sequence[str] = (),
                 keep_logprobs: bool = True, think: Optional[ThinkSplitter] = None, include_stop: bool = False,
                 skip_special_tokens: bool = True):
        """`keep_logprobs`: hold every returned token's logprob entry in `logprobs` (a response answered whole
        needs them; a streamed one sends each feed's `last_logprobs` and keeps `logprobs` empty). `think`: split
        the reasoning out (needs a tokenizer). `include_stop`: a matched stop string stays at the end of the text.
        `skip_special_tokens`: special tokens have no text (False: the text of the content has them)."""
        if (stop or think is not None) and tokenizer is None:
            raise ValueError("stop strings and reasoning need a tokenizer")
        self.think = think
        self.rdetok = IncrementalDetokenizer(tokenizer) if think is not None else None
        self.reasoning_texts: list[str] = []
        self.last_reasoning = ""  # reasoning text of the latest feed
        self.reasoning_tokens = 0  # completion tokens of the think block, its tags included
        self.index = index
        self.num_prompt_tokens = num_prompt_tokens
        self.cached_tokens = 0  # prompt tokens from the prefix cache (the engine's `RequestOutput.num_cached_tokens`)
        self.prompt_lp: Optional[list] = None  # the engine's `RequestOutput.prompt_logprobs`, once they came
        self.first_sent = False  # a streamed completions choice sent its first chunk (its echo, its prompt_logprobs)
        self.echo_only = False  # `echo` with `max_tokens: 0`: the generated token is dropped, the choice ends `length`
        self.detok = IncrementalDetokenizer(tokenizer, skip_special_tokens) if tokenizer is not None else None
        self.stop = StopStringMatcher(stop, include_stop) if stop else None
        self.token_ids: list[int] = []
        self.texts: list[str] = []  # every text delta (the non-streamed response joins them)
        self.finish_reason: Optional[str] = None
        self.done = False
        self.stopped_early = False  # a stop string ended the choice before the engine finished the request
        # logprob entries aligned with `token_ids` (None: the request did not ask; empty unless `keep_logprobs`),
        # held as tuples of numbers (which the garbage collector stops following; `launch.logprobs` reads either);
        # `last_logprobs`: those of the tokens the latest `feed` returned, as the engine gave them;
        # `last_text_start`: the characters of text before that feed's text
        self.logprobs: Optional[list] = None
        self._keep_logprobs = keep_logprobs
        self.last_logprobs: list = []
        self._lp_queue: list = []
        self.text_len = 0
        self.last_text_start = 0

    @property
    def text(self) -> str:
        return "".join(self.texts)

    @property
    def reasoning_text(self) -> Optional[str]:
        """The think block's text (None: no reasoning parser, or the choice did not reason)."""
        return "".join(self.reasoning_texts) if self.reasoning_tokens else None

    def feed(self, new_ids: list[int], finished: bool, finish_reason: Optional[str],
             stop_token: bool = False, new_logprobs: Optional[list] = None) -> tuple[str, list[int]]:
        """Text and token ids to send for this update (either may be empty). `stop_token`: the last of `new_ids`
        is the stop token that finished the request (counted, no text). `new_logprobs`: the engine's entries of
        `new_ids` (then `last_logprobs` holds those of the returned tokens)."""
        self.last_reasoning = ""
        if self.done:
            self.last_logprobs = []
            return "", []
        if new_logprobs is not None:
            if self.logprobs is None:
                self.logprobs = []
            self._lp_queue.extend(new_logprobs)
        start = self.text_len
        text, tokens = (self._feed_tokens(new_ids, finished, finish_reason, stop_token) if self.think is None
                        else self._feed_split(new_ids, finished, finish_reason, stop_token))
        self.last_text_start, self.text_len = start, start + len(text)
        if self.logprobs is not None:
            q, k = self._lp_queue, len(tokens)
            self.last_logprobs, self._lp_queue = (q, []) if k == len(q) else (q[:k], q[k:])
            if self._keep_logprobs:
                self.logprobs.extend([(c, tuple(ids), tuple(lps)) for c, ids, lps in self.last_logprobs])
        return text, tokens

    def _feed_split(self, new_ids: list[int], finished: bool, finish_reason: Optional[str],
                    stop_token: bool) -> tuple[str, list[int]]:
        """`_feed_tokens` with the think block's tokens (and tags) taken out of the content first."""
        eos = new_ids[-1:] if stop_token and finished and new_ids else []
        texts, tokens = [], []
        for kind, ids in self.think.split(new_ids[:-1] if eos else new_ids):
            if kind == "content":
                text, taken = self._feed_tokens(ids, False, None, False)
                texts.append(text)
                tokens.extend(taken)
                if self.done:  # a stop string matched
                    return "".join(texts), tokens
                continue
            self.token_ids.extend(ids)
            tokens.extend(ids)
            self.reasoning_tokens += len(ids)
            if kind == "reasoning":
                self._reason(self.rdetok.push(ids))
            elif ids[0] == self.think.tags.end:  # the closing tag: the think block's text is complete
                self._reason(self.rdetok.flush())
        if finished:
            self._reason(self.rdetok.flush())
            text, taken = self._feed_tokens(eos, True, finish_reason, bool(eos))
            texts.append(text)
            tokens.extend(taken)
        return "".join(texts), tokens

    def _reason(self, text: str) -> None:
        if text:
            self.reasoning_texts.append(text)
            self.last_reasoning += text

    def _feed_tokens(self, new_ids: list[int], finished: bool, finish_reason: Optional[str],
                     stop_token: bool) -> tuple[str, list[int]]:
        if self.done:
            return "", []
        if stop_token and finished and new_ids:
            text, tokens = self._feed_tokens(new_ids[:-1], False, None, False) if len(new_ids) > 1 else ("", [])
            if self.done:  # a stop string matched before the stop token
                return text, tokens
            tail, _ = self._feed_tokens([], True, finish_reason, False)
            self.token_ids.append(new_ids[-1])
            return text + tail, [*tokens, new_ids[-1]]
        if self.stop is None:
            self.token_ids.extend(new_ids)
            text = self.detok.push(new_ids) if self.detok is not None and new_ids else ""
            if finished:
                if self.detok is not None:
                    text += self.detok.flush()
                self.done, self.finish_reason = True, finish_reason
            if text:
                self.texts.append(text)
            return text, new_ids
        return self._feed_with_stops(new_ids, finished, finish_reason)

    def _feed_with_stops(self, new_ids: list[int], finished: bool,
                         finish_reason: Optional[str]) -> tuple[str, list[int]]:
        parts: list[str] = []
        taken = 0
        matched = False
        for t in new_ids:
            taken += 1
            safe, matched = self.stop.push(self.detok.push((t,)))
            parts.append(safe)
            if matched:
                break
        if matched:
            self.stopped_early = not finished
        elif finished:
            safe, matched = self.stop.push(self.detok.flush())
            parts.append(safe)
            if not matched:
                parts.append(self.stop.flush())
        if matched or finished:
            self.done = True
            self.finish_reason = "stop" if matched else finish_reason
        tokens = new_ids if taken == len(new_ids) else new_ids[:taken]
        self.token_ids.extend(tokens)
        text = "".join(parts)
        if text:
            self.texts.append(text)
        return text, tokens
