"""Host cost per streamed token of a chat choice's output path with and without the reasoning and tool-call parsers
(CPU only, no model, no server): `ChoiceState.feed` (detokenisation, the think-block split) and `Shape.delta` (the
tool-call scan, the chunk's JSON), one token a feed, on the fixture checkpoint's tokenizer
(`tests.fixtures.hf_checkpoints`) or `--tokenizer DIR`. "plain, tokenizer.decode" is the plain path of the
detokenizer: every decode through `tokenizer.decode` rather than its `tokenizers` backend
(`launch.detokenizer.backend_decoder`).

    python -m bench.chat_parsers --tokens 2000 --rounds 5

The answer is a think block, text and one `<tool_call>` block; every mode streams the same tokens. Reported: the
smallest round median (us per token) and the ratio to the plain path, side by side in one run.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

from launch.generation import Shape
from launch.outputs import ChoiceState
from launch.reasoning import splitter_for, think_tags
from launch.tools import ToolChoice

MODES = ("plain", "plain, tokenizer.decode", "reasoning", "tools", "reasoning+tools")


def _answer(tok, n: int) -> list[int]:
    vocab = tok.get_vocab()
    words = tok.encode(" The quick brown fox jumps over the lazy dog, and the cache keeps blocks.",
                       add_special_tokens=False)
    body = (words * (n // len(words) + 1))[: max(1, n // 2)]
    call = tok.encode('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
                      add_special_tokens=False)
    return [vocab["<think>"], *body, vocab["</think>"], *body[: n // 4], *call]


def per_token_us(tok, ids: list[int], mode: str) -> float:
    tags = think_tags(tok, "qwen3") if "reasoning" in mode else None
    shape = Shape(True, tok, tags, ToolChoice("auto") if "tools" in mode else None)
    c = ChoiceState(0, 10, tok, (), keep_logprobs=False, think=splitter_for(tags, [1]))
    if mode.endswith("tokenizer.decode"):  # the plain path of the detokenizer: every decode through transformers
        c.detok._backend = None
    t0 = time.perf_counter()
    for i, t in enumerate(ids):
        last = i == len(ids) - 1
        ch = shape.delta(c, *c.feed([t], last, "stop" if last else None))
        if ch is not None:
            json.dumps(ch)
    return (time.perf_counter() - t0) / len(ids) * 1e6


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--tokenizer", default=None, help="a local checkpoint directory (default: the fixture's)")
    args = p.parse_args(argv)
    if args.tokenizer:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(args.tokenizer, local_files_only=True)
    else:
        from tests.fixtures.hf_checkpoints import build_tokenizer

        tok = build_tokenizer()
    ids = _answer(tok, args.tokens)
    runs = {m: [] for m in MODES}
    for _ in range(args.rounds):
        for m in MODES:  # interleaved: a busy host disturbs every mode alike
            runs[m].append(statistics.median(per_token_us(tok, ids, m) for _ in range(3)))
    best = {m: min(v) for m, v in runs.items()}
    print(f"{'mode':<24} {'us/token':>9} {'x plain':>8}   ({len(ids)} tokens a choice)")
    for m in MODES:
        print(f"{m:<24} {best[m]:9.2f} {best[m] / best['plain']:8.2f}")
    return best


if __name__ == "__main__":
    main()
