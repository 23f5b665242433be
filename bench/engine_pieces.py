"""The engine's and the server's host pieces of one decode step, for `bench.driver_overhead` (CPU only, no model).

"engine_step": `LLMEngine.step()` of B running requests sampled as a `bench.dist_bench.SAMPLING_MODES` mode, over
an executor that hands back a fixed result at once (int64 `[B]` tokens, or `SampledTokens` with the mode's top-N
logprobs): scheduling, the step batch and its sampler extras, the tokens' and logprobs' bookkeeping, the outputs.
"openai_completion_lp" / "openai_chat_lp" (logprob modes only): the server's conversion of one step's logprob
entries to the OpenAI completions / chat shapes (`launch.logprobs`), one call per row as a stream of B requests
makes them, with the tokenizer of `--tokenizer` (a local checkpoint directory; none: `token_id:<id>` strings).
"""
from __future__ import annotations

import time
from typing import Any, Callable, Optional

import numpy as np

from actors.batch import SampledTokens, StepLogprobs


class FixedExecutor:
    """The engine's executor surface with no model: every step returns `result(batch)` at once."""

    def __init__(self, vocab: int, max_model_len: int = 65536, num_kv_blocks: int = 200000, block_size: int = 64):
        from engine.testing import ToyModelConfig

        self.model_config = ToyModelConfig(vocab, max_model_len)
        self.max_model_len, self.num_kv_blocks, self.block_size, self.dp_size = (max_model_len, num_kv_blocks,
                                                                                 block_size, 1)
        self._results: dict[tuple[int, int], Any] = {}

    def result(self, b: int, num_logprobs: int) -> Any:
        """Tokens int64 `[b]`, or with `num_logprobs` >= 0 `SampledTokens` with that many top entries (made once)."""
        key = (b, num_logprobs)
        if key not in self._results:
            g = np.random.default_rng(b)
            tokens = np.full(b, 7, dtype=np.int64)
            if num_logprobs < 0:
                self._results[key] = tokens
            else:
                ids = g.integers(0, self.model_config.vocab_size, (b, num_logprobs)).astype(np.int32)
                lps = np.sort(-g.random((b, num_logprobs), dtype=np.float32), axis=1)[:, ::-1].copy()
                self._results[key] = SampledTokens(tokens, StepLogprobs(lps[:, 0].copy(), ids, lps))
        return self._results[key]

    def step(self, batches, num_steps: int = 1):
        return [None if b is None else self.result(b.batch_size, -1 if b.extras is None else b.extras.num_logprobs)
                for b in batches]


def engine_extras(b: int, num_logprobs: int) -> Any:
    """The `SamplerExtras` `engine.sampling_rows.build_extras` makes for `b` rows that only ask for logprobs."""
    from engine.request import Request
    from engine.sampling_params import SamplingParams
    from engine.sampling_rows import build_extras
    from engine.sequence import Sequence

    sp = SamplingParams(logprobs=num_logprobs)
    return build_extras([Sequence(Request.make([1, 2], sp, max_tokens=8)) for _ in range(b)])


def engine_step_fn(b: int, mode: str, context: int, vocab: int, steps: int) -> Callable[[], Any]:
    """`LLMEngine.step` of `b` decoding requests of sampling `mode` with `context`-token prompts, room for `steps`
    more steps (after a few warm-up steps)."""
    from bench.dist_bench import SAMPLING_MODES
    from engine.llm_engine import EngineConfig, LLMEngine
    from engine.sampling_params import SamplingParams

    temp, top_k, top_p, logprobs = SAMPLING_MODES[mode]
    sp = SamplingParams(temperature=temp, top_k=top_k, top_p=top_p, logprobs=None if logprobs < 0 else logprobs)
    eng = LLMEngine(FixedExecutor(vocab), EngineConfig(max_num_seqs=max(256, b)))
    rng = np.random.default_rng(0)
    for _ in range(b):
        eng.add_request(eng.make_request(rng.integers(0, vocab, context).tolist(), sp, max_tokens=steps + 1000))
    for _ in range(5):
        eng.step()
    return eng.step


def mean_us(fn: Callable[[], Any], n: int) -> float:
    """Microseconds per call of `n` calls in one run (what a long run costs: collections and outliers included)."""
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1e6


def openai_fns(b: int, mode: str, vocab: int, tokenizer: Any) -> dict[str, Callable[[], Any]]:
    """The server's logprob conversions of one step of `b` streamed requests (none for a mode without logprobs)."""
    from bench.dist_bench import SAMPLING_MODES
    from launch.logprobs import chat_logprobs, completion_logprobs

    n = SAMPLING_MODES[mode][3]
    if n < 0:
        return {}
    g = np.random.default_rng(b)
    if tokenizer is not None:
        vocab = min(vocab, len(tokenizer))
    toks = g.integers(0, vocab, b).tolist()
    entries = [(float(-g.random()), g.integers(0, vocab, n).tolist(), sorted((-g.random(n)).tolist(), reverse=True))
               for _ in range(b)]
    rows = [([t], [e]) for t, e in zip(toks, entries)]
    return {"openai_completion_lp": lambda: [completion_logprobs(tokenizer, t, e, 100) for t, e in rows],
            "openai_chat_lp": lambda: [chat_logprobs(tokenizer, t, e) for t, e in rows]}


def load_tokenizer(path: Optional[str]) -> Any:
    if not path:
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True)
