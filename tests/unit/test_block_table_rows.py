"""The step's block tables come from each sequence's cached int32 copy of its table (`Sequence.block_table_array`,
made again only when the table grew or was replaced): over a long randomized run with arrivals, finishes, chunked
prefill, prefix-cache hits and preemptions (a small KV pool), every step's `block_tables` equals the tables built
from the sequences' lists as they are now."""
import numpy as np

from engine.request import Request
from engine.scheduler import Scheduler, SchedulerConfig
from engine.sequence import Sequence


def _plain(seqs) -> np.ndarray:
    width = max(len(s.block_table) for s in seqs)
    out = np.zeros((len(seqs), width), dtype=np.int32)
    for i, s in enumerate(seqs):
        out[i, : len(s.block_table)] = s.block_table
    return out


def test_every_step_equals_the_tables_of_the_lists():
    rng = np.random.default_rng(0)
    s = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=24, max_model_len=96, watermark_blocks=0),
                  40, 4)  # 40 blocks of 4 tokens: preemption under load
    shared = rng.integers(0, 50, 12).tolist()  # a common prefix: prefix-cache hits reassign tables
    steps = preempted = 0
    for step in range(600):
        if rng.random() < 0.3 and len(s.waiting) < 6:
            prompt = (shared if rng.random() < 0.5 else []) + rng.integers(0, 50, int(rng.integers(1, 20))).tolist()
            s.add(Sequence(Request.make(prompt, max_tokens=int(rng.integers(1, 40)))))
        b = s.schedule()
        if b is None:
            continue
        steps += 1
        assert np.array_equal(b.batch.block_tables, _plain(b.seqs)), step
        preempted = max(preempted, sum(q.num_preemptions for q in b.seqs))
        s.update(b, rng.integers(0, 50, len(b.seqs)))
    assert steps > 300 and preempted > 0  # the run exercised preemption (tables freed and made again)
