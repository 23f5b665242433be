"""Reasoning output of chat completions (`graphline serve --reasoning-parser qwen3`): the text a Qwen3-style model
writes inside `<think>` ... `</think>` goes to the message's `reasoning_content` (streamed: `delta.reasoning_content`),
the rest to `content`, as vLLM's and SGLang's `--reasoning-parser qwen3` do.

The split works on token ids, never on text: `<think>` and `</think>` are single tokens of the checkpoint's
tokenizer (`think_tags` checks it at start-up), so a tag split across stream chunks or detokenised away (a tokenizer
that marks them special) splits the same. A choice reasons when
- its prompt ends inside an open think block (a template that pre-fills `<think>` after the assistant header), or
- its first generated token is `<think>`;
and then every token up to the first `</think>` is reasoning, every later token content. Otherwise (no thinking,
or `enable_thinking: false`, whose template pre-fills an empty, closed block) every token is content. The tags
themselves are counted as completion tokens but appear in neither text. A choice that ends before `</think>` (max
tokens) has reasoning and no content, streamed or not. Stop strings apply to the content only.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

REASONING_PARSERS = ("qwen3",)


class ReasoningParserError(ValueError):
    """The tokenizer cannot serve the requested reasoning parser (raised at start-up, before any rank starts)."""


@dataclass(frozen=True)
class ThinkTags:
    """Token ids of the think tags, and of the turn header (`<|im_start|>`, -1 when absent) that bounds a prompt's
    own generation prefix."""

    start: int
    end: int
    turn_start: int = -1


def think_tags(tokenizer: Any, parser: str) -> ThinkTags:
    """The tags of `parser` in `tokenizer`; ReasoningParserError naming what is missing."""
    if parser not in REASONING_PARSERS:
        raise ReasoningParserError(f"--reasoning-parser {parser!r}: the parsers are {', '.join(REASONING_PARSERS)}")
    if tokenizer is None:
        raise ReasoningParserError("--reasoning-parser needs a checkpoint with a tokenizer (a preset has none)")
    vocab = tokenizer.get_vocab()
    missing = [t for t in ("<think>", "</think>") if t not in vocab]
    if missing:
        raise ReasoningParserError(f"--reasoning-parser {parser}: the tokenizer has no {' or '.join(missing)} token; "
                                   "serve this checkpoint without --reasoning-parser")
    return ThinkTags(vocab["<think>"], vocab["</think>"], vocab.get("<|im_start|>", -1))


def prompt_opens_thinking(prompt: Sequence[int], tags: ThinkTags) -> bool:
    """Whether `prompt` ends inside an open think block of its own generation prefix: its last `<think>` comes
    after its last `</think>` and its last turn header."""
    for t in reversed(prompt):
        if t == tags.start:
            return True
        if t == tags.end or t == tags.turn_start:
            return False
    return False


class ThinkSplitter:
    """The generated tokens of one choice, split into reasoning and content as they arrive."""

    __slots__ = ("tags", "state")

    # states: "first" (nothing generated yet, not reasoning), "reasoning", "content"
    def __init__(self, tags: ThinkTags, prompt: Sequence[int]):
        self.tags = tags
        self.state = "reasoning" if prompt_opens_thinking(prompt, tags) else "first"

    def split(self, ids: Sequence[int]) -> list[tuple[str, list[int]]]:
        """`ids` (the next generated tokens) as runs `(kind, ids)` in order, kind "reasoning", "content" or "tag"
        (a think tag: counted, no text)."""
        runs: list[tuple[str, list[int]]] = []
        i, n = 0, len(ids)
        while i < n:
            if self.state == "content":
                runs.append(("content", list(ids[i:])))
                break
            if self.state == "first":
                if ids[i] == self.tags.start:
                    runs.append(("tag", [ids[i]]))
                    self.state, i = "reasoning", i + 1
                else:
                    self.state = "content"
                continue
            j = i
            while j < n and ids[j] != self.tags.end:
                j += 1
            if j > i:
                runs.append(("reasoning", list(ids[i:j])))
            if j < n:
                runs.append(("tag", [ids[j]]))
                self.state = "content"
            i = j + 1
        return runs


def splitter_for(tags: Optional[ThinkTags], prompt: Sequence[int]) -> Optional[ThinkSplitter]:
    return None if tags is None else ThinkSplitter(tags, prompt)
