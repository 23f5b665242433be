"""Previous-step token references mixed with real token ids in one step (`RankStepIO._resolve_ids`): the real ids
stay what they are on the device, the references take the previous step's tokens, and the host copy holds the
real ids with references as 0. Through a CPU rank, such a step (a chunked-prefill step whose decode rows refer to
the step before and whose prompt chunk is on the host) gives the tokens of the same step with host ids."""
import numpy as np
import torch

from actors.batch import StepBatch, prev_token
from actors.rank import RankRuntime
from actors.rank_io import RankStepIO
from actors.runtime_config import RuntimeConfig
from parallel.context import ParallelContext


class _Rank(RankStepIO):
    device = torch.device("cpu")

    def __init__(self, last: torch.Tensor):
        self._last_tokens = last

    @property
    def prev_rows(self) -> int:
        return int(self._last_tokens.shape[0])


def test_partial_references_keep_the_real_ids():
    last = torch.tensor([500, 501, 502], dtype=torch.int64)
    host, dev = _Rank(last)._resolve_ids(np.array([prev_token(2), 42, 43, prev_token(0), 7], np.int64))
    assert host.tolist() == [0, 42, 43, 0, 7]
    assert dev.tolist() == [502, 42, 43, 500, 7]
    host, dev = _Rank(last)._resolve_ids(np.array([prev_token(1), prev_token(0)], np.int64))  # all, permuted
    assert host.tolist() == [0, 0] and dev.tolist() == [501, 500]
    host, dev = _Rank(last)._resolve_ids(np.array([prev_token(0), prev_token(1)], np.int64))  # the decode loop
    assert host.tolist() == [0, 0] and dev.tolist() == [500, 501]
    host, dev = _Rank(last)._resolve_ids(np.array([3, 4], np.int64))
    assert host.tolist() == [3, 4] and dev is None


@torch.inference_mode()
def test_a_mixed_step_with_references_equals_the_step_with_host_ids():
    rt = RankRuntime(RuntimeConfig(model="qwen3-tiny", device="cpu", num_kv_blocks=64, max_model_len=512),
                     ParallelContext(), torch.device("cpu"))
    rt.load_model()
    rt.allocate_kv_cache()
    rt.build_runner()
    rng = np.random.default_rng(0)
    vocab = rt.model_config.vocab_size
    prompts = [[int(x) for x in rng.integers(0, vocab, n)] for n in (9, 30, 17)]
    tables = [[1 + 2 * i, 2 + 2 * i] for i in range(3)]
    chunk = [int(x) for x in rng.integers(0, vocab, 40)]
    first = rt.execute(StepBatch.from_sequences(prompts, [0, 0, 0], tables))
    hist = [len(p) for p in prompts]
    step1 = StepBatch.from_sequences([[int(t)] for t in first], hist, tables)
    toks = rt.execute(step1)
    hist2 = [h + 1 for h in hist]
    refs = StepBatch.from_sequences([[prev_token(2)], [prev_token(0)], [prev_token(1)]] + [chunk], hist2 + [0],
                                    [tables[0], tables[1], tables[2], [20]])
    # rows 0..2 are sequences 0..2, fed the previous step's tokens of rows 2, 0, 1 (a permuted decode)
    got = rt.execute(refs)
    rt.execute(step1)  # the previous step again (the same K/V and tokens)
    host = StepBatch.from_sequences([[int(toks[2])], [int(toks[0])], [int(toks[1])]] + [chunk], hist2 + [0],
                                    [tables[0], tables[1], tables[2], [20]])
    np.testing.assert_array_equal(got, rt.execute(host))
