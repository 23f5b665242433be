"""Host cost of structured outputs per step: filling a constrained row's allowed-token bitmask and advancing its
grammar (`engine.grammar.GrammarState`), at a real model's vocabulary size, on the driver's CPU.

    python -m bench.grammar_mask_bench [--vocab 151936] [--steps 200] [--rows 1,16,64]

No checkpoint ships with the repository, so the tokenizer is a synthetic byte-level BPE vocabulary of Qwen3's size
(151,643 ids plus its three special tokens; byte tokens, then random lower-case words half with a leading space,
capitalised words and runs of JSON punctuation and digits). Each row walks its grammar with random allowed tokens
(seeded) until the grammar completes or `--steps`; a completed row starts over. Printed: us per step for all rows
(fill + advance; several rows on llguidance's thread pool as in the engine, `--threads 0`: one after another),
median and p99, against the same rows' plain `np.full` of an unconstrained mask.
"""
from __future__ import annotations

import argparse
import time

import numpy as np

SCHEMAS = {
    "json_object": {"type": "object"},
    "json_schema": {"type": "object", "properties": {
        "name": {"type": "string"}, "age": {"type": "integer"}, "tags": {"type": "array", "items": {"type": "string"}},
        "ok": {"type": "boolean"}}, "required": ["name", "age", "tags", "ok"], "additionalProperties": False},
}


def synthetic_tokenizer(size: int, seed: int = 0):
    """A transformers fast tokenizer with `size` regular ids (byte-level BPE vocabulary, no merges) and Qwen's
    three special tokens after them."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    rng = np.random.default_rng(seed)
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    letters, punct = list("abcdefghijklmnopqrstuvwxyz"), list('{}[]":,.0123456789')
    while len(vocab) < size:
        r = rng.random()
        if r < 0.1:
            w = "".join(rng.choice(punct, int(rng.integers(2, 5))))
        else:
            w = "".join(rng.choice(letters, int(rng.integers(2, 12))))
            w = "Ġ" + w if r < 0.6 else w.capitalize() if r < 0.7 else w
        vocab.setdefault(w, len(vocab))
    for special in ("<|endoftext|>", "<|im_start|>", "<|im_end|>"):
        vocab[special] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>")


def run(args: argparse.Namespace) -> None:
    from engine.grammar import fill_masks, mask_words
    from launch.structured import GrammarCompiler

    tok = synthetic_tokenizer(args.tokens)
    t0 = time.perf_counter()
    compiler = GrammarCompiler(tok, args.vocab, [tok.eos_token_id])
    compiler.json_schema(SCHEMAS["json_object"], "json_object", "schema")  # builds the shared llguidance tokenizer
    print(f"vocabulary {args.vocab} ids ({args.tokens} + 3 special); tokenizer for the grammars built in "
          f"{time.perf_counter() - t0:.2f} s")
    words = mask_words(args.vocab)
    rng = np.random.default_rng(1)
    for kind, schema in SCHEMAS.items():
        t0 = time.perf_counter()
        grammar = compiler.json_schema(schema, kind, "schema")
        compile_ms = (time.perf_counter() - t0) * 1e3
        for rows in args.rows:
            states = [grammar.start() for _ in range(rows)]
            steps, plain = [], []
            for _ in range(args.steps):
                t1 = time.perf_counter()
                np.full((rows, words), -1, np.int32)
                t2 = time.perf_counter()
                mask = np.full((rows, words), -1, np.int32)
                fill_masks(mask, list(enumerate(states)), grammar.executor if args.threads else None)
                t3 = time.perf_counter()
                picks = []  # the sampler's part, not timed: a random allowed id per row
                for i in range(rows):
                    allowed = np.flatnonzero(np.unpackbits(mask[i].view(np.uint8), bitorder="little")[:args.vocab])
                    picks.append(int(rng.choice(allowed)))
                t4 = time.perf_counter()
                for i, st in enumerate(states):
                    if picks[i] == tok.eos_token_id or st.advance(picks[i]):
                        states[i] = grammar.start()
                t5 = time.perf_counter()
                plain.append(t2 - t1)
                steps.append((t3 - t2) + (t5 - t4))
            s, p = np.array(steps) * 1e6, np.array(plain) * 1e6
            print(f"{kind:>11}, {rows:>3} rows: mask + advance {np.median(s):8.1f} us median, "
                  f"{np.percentile(s, 99):8.1f} p99 (an unconstrained mask alone {np.median(p):6.1f} us); "
                  f"compile {compile_ms:.1f} ms")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocab", type=int, default=151936, help="model vocabulary (mask width)")
    p.add_argument("--tokens", type=int, default=151643, help="regular tokenizer ids (specials come after)")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--threads", type=int, default=1, help="1: several rows on llguidance's thread pool (as the "
                   "engine fills them); 0: one row after another")
    p.add_argument("--rows", type=lambda s: [int(x) for x in s.split(",")], default=[1, 16, 64])
    run(p.parse_args())


if __name__ == "__main__":
    main()
