"""Shared pieces of the Ray + gloo tests: small configs, a Ray session, and a scripted
multi-DP-rank scenario that runs on a coordinator and on one in-process reference rank."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np

from actors.batch import StepBatch
from actors.rank import RuntimeConfig
from graphrunner.config import GraphRunnerConfig

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

GRAPH = GraphRunnerConfig(max_decode_batch=4, pcg_max_tokens=64, pcg_token_stride=32)
BLOCK, BLOCKS_PER_SEQ = 16, 4


def runtime_cfg(model: str = "qwen3-tiny", **kw) -> RuntimeConfig:
    base = dict(model=model, device="cpu", block_size=BLOCK, num_kv_blocks=64, max_model_len=BLOCK * BLOCKS_PER_SEQ,
                graph=GRAPH)
    base.update(kw)
    return RuntimeConfig(**base)


def ray_session(num_gpus: Optional[int] = None):
    import ray

    if ray.is_initialized():
        ray.shutdown()
    kw = {} if num_gpus is None else {"num_gpus": num_gpus}
    ray.init(num_cpus=4, include_dashboard=False, **kw)
    return ray


@dataclass
class Seq:
    tokens: list[int]
    table: list[int]
    cached: int = 0  # tokens already in the KV cache


@dataclass
class Scenario:
    """Sequences per DP rank; an action is ("new", name, prompt) or ("dec", name)."""

    seqs: dict[str, Seq] = field(default_factory=dict)
    next_block: int = 1
    blocks_per_seq: int = BLOCKS_PER_SEQ

    def batch(self, actions: Optional[Sequence[tuple]]) -> Optional[StepBatch]:
        if actions is None:
            return None
        toks, hist, tables, names = [], [], [], []
        for a in actions:
            if a[0] == "new":
                self.seqs[a[1]] = Seq(list(a[2]), list(range(self.next_block, self.next_block + self.blocks_per_seq)))
                self.next_block += self.blocks_per_seq
            s = self.seqs[a[1]]
            toks.append(s.tokens[s.cached:])
            hist.append(s.cached)
            tables.append(s.table)
            names.append(a[1])
        self._pending = names
        return StepBatch.from_sequences(toks, hist, tables)

    def advance(self, names: Sequence[str], out: np.ndarray) -> None:
        for n, t in zip(names, out.tolist()):
            s = self.seqs[n]
            s.cached = len(s.tokens)
            s.tokens.append(int(t))


def run_scenario(coord, reference, script: Sequence[Sequence[Optional[Sequence[tuple]]]]) -> list[list]:
    """Run every step of `script` (one entry per DP rank per step) on the coordinator, and each DP
    rank's batch on the single-rank `reference` runtime; assert equal tokens; returns the outputs."""
    sc = Scenario()
    history = []
    for i, step in enumerate(script):
        batches, names = [], []
        for actions in step:
            batches.append(sc.batch(actions))
            names.append(list(sc._pending) if actions is not None else None)
        outs = coord.step(batches)
        for d, (b, o) in enumerate(zip(batches, outs)):
            if b is None:
                assert o is None, (i, d)
                continue
            ref = reference.execute(b)
            assert o is not None and np.array_equal(o, ref), f"step {i} DP rank {d}: {o} != reference {ref}"
            sc.advance(names[d], o)
        history.append(outs)
    return history


def run_submitted_ahead(coord, reference, prompts: Sequence[Sequence[Sequence[int]]], steps: int,
                        permute: bool = False, blocks_per_seq: int = BLOCKS_PER_SEQ) -> list[list[list[int]]]:
    """Prefill each DP rank's `prompts[d]`, then `steps` decode steps submitted one ahead of their collection,
    every token id a previous-step reference (`prev_token`); with `permute` the rows of DP rank 0 are reversed
    each step (references then gather). Asserts each DP rank's tokens equal the single-rank `reference` fed
    step by step through the host; returns the generated tokens per DP rank and sequence."""
    from actors.batch import prev_token

    n_dp = len(prompts)
    tables, nxt, block = [], 1, blocks_per_seq
    for d in range(n_dp):
        tables.append([list(range(nxt + block * j, nxt + block * (j + 1))) for j in range(len(prompts[d]))])
        nxt += block * len(prompts[d])
    order = [list(range(len(p))) for p in prompts]  # order[d][row] = sequence index in the current batch
    hist = [[len(s) for s in p] for p in prompts]
    first = coord.step([StepBatch.from_sequences(p, [0] * len(p), t) for p, t in zip(prompts, tables)])
    gen = [[[int(t)] for t in f] for f in first]
    tickets = []
    for k in range(steps):
        batches = []
        for d in range(n_dp):
            prev = order[d]
            cur = prev[::-1] if permute and d == 0 else prev
            toks = [[prev_token(prev.index(s))] for s in cur]
            batches.append(StepBatch.from_sequences(toks, [hist[d][s] for s in cur], [tables[d][s] for s in cur]))
            for s in cur:
                hist[d][s] += 1
            order[d] = cur
        tickets.append((coord.submit(batches), [list(o) for o in order]))
        while len(tickets) == 2 or (tickets and k == steps - 1):  # one step stays queued behind the running one
            t, rows = tickets.pop(0)
            for d, out in enumerate(coord.collect(t)):
                for r, tok in enumerate(out.tolist()):
                    gen[d][rows[d][r]].append(int(tok))
    for d in range(n_dp):  # the reference: one rank, tokens fed back through the host
        h = [0] * len(prompts[d])
        cur = StepBatch.from_sequences(prompts[d], h, tables[d])
        want = [[int(t)] for t in reference.execute(cur)]
        for _ in range(steps):
            cur = StepBatch.from_sequences([[w[-1]] for w in want], [len(p) + len(w) - 1 for p, w in
                                                                      zip(prompts[d], want)], tables[d])
            for w, t in zip(want, reference.execute(cur).tolist()):
                w.append(int(t))
        assert gen[d] == want, f"DP rank {d}: submitted ahead {gen[d]} != reference {want}"
    return gen


def greedy_with_and_without_logits_observer(coord, prompts: Sequence[Sequence[int]], tables: Sequence[Sequence[int]],
                                            steps: int, timeout_s: float = 60.0) -> list[list[list[int]]]:
    """The greedy tokens of `prompts` (prefill, then `steps` decode steps fed through the host) on a DP=1
    coordinator, run twice on the same block tables: with every rank's logits observer set (the fp32 logits
    head) and without (the greedy head). Returns both runs; the caller compares them."""
    import ray

    runs = []
    for record in (True, False):
        for w in coord._ranks.workers:
            ray.get((w._test_record_logits if record else w._test_stop_recording_logits).remote(), timeout=timeout_s)
        out = [[int(t)] for t in coord.step([StepBatch.from_sequences(prompts, [0] * len(prompts), tables)])[0]]
        for j in range(steps):
            b = StepBatch.from_sequences([[o[-1]] for o in out], [len(p) + j for p in prompts], tables)
            for o, t in zip(out, coord.step([b])[0].tolist()):
                o.append(int(t))
        runs.append(out)
    return runs


def decode_script(n_dp: int, prompts: Sequence[Sequence[int]], steps: int) -> list:
    """Every DP rank prefills its own prompts (different per rank), then decodes `steps` times."""
    script = [[[("new", f"d{d}s{j}", p) for j, p in enumerate(prompts[d::n_dp])] for d in range(n_dp)]]
    for _ in range(steps):
        script.append([[("dec", f"d{d}s{j}") for j in range(len(prompts[d::n_dp]))] for d in range(n_dp)])
    return script


class CoordinatorCache:
    """At most one live coordinator per test module (2 ranks = 2 of the session's 4 CPUs)."""

    def __init__(self):
        self.name, self.coord, self.timings = None, None, None

    def get(self, name: str, cfg):
        from actors.coordinator import Coordinator

        if self.name != name:
            self.close()
            self.coord = Coordinator(cfg)
            self.timings = self.coord.start(progress=False)
            self.name = name
        return self.coord

    def close(self) -> None:
        if self.coord is not None:
            self.coord.shutdown()
        self.name, self.coord, self.timings = None, None, None


def assert_prefill_logits_equal_reference(coord, reference, timeout_s: float = 30.0) -> None:
    """The full-vocabulary fp32 logits of one prefill step on a DP=1 coordinator (TP rank 0's, all-gathered over
    TP) equal the single-rank `reference`'s for the same batch; the ranks stop recording afterwards."""
    import ray

    for w in coord._ranks.workers:
        ray.get(w._test_record_logits.remote(), timeout=timeout_s)
    b = StepBatch.from_sequences([[3, 1, 4, 1, 5, 9, 2, 6]], [0], [[40, 41]])
    coord.step([b])
    got = ray.get(coord._ranks.workers[0]._test_last_logits.remote(), timeout=timeout_s)
    seen = {}
    reference.logits_observer = lambda logits: seen.setdefault("x", logits.clone())
    try:
        reference.execute(b)
    finally:
        reference.logits_observer = None
    for w in coord._ranks.workers:
        ray.get(w._test_stop_recording_logits.remote(), timeout=timeout_s)
    np.testing.assert_allclose(got, seen["x"].numpy(), rtol=1e-4, atol=1e-4)
