"""How `RankSet.wait` names the ranks of a failed call, with real Ray actors (no model): a rank that raised
because a peer vanished is reported after that peer's death, which is named first; an error with no death
behind it is reported alone, after the grace window, the stuck peer left to the teardown."""
import os
import time

import pytest
import ray

from actors import rankset
from actors.rankset import RankCallError, RankSet

MODEL = "qwen3-tiny"  # unused: the module's fixtures want a model name


@pytest.fixture(scope="module")
def actors(ray_mod):
    @ray_mod.remote(num_cpus=0)
    class Peer:
        def raise_now(self):
            raise RuntimeError("Read error: Connection reset by peer")

        def die_after(self, s: float):
            time.sleep(s)
            os._exit(1)

        def hang(self, s: float):
            time.sleep(s)
            return "late"

    return Peer


def test_a_peer_death_behind_a_collective_error_is_named_first(actors):
    a, b = actors.remote(), actors.remote()
    ranks = RankSet([a, b], [], None)
    refs = {a.raise_now.remote(): 0, b.die_after.remote(0.5): 1}
    with pytest.raises(RankCallError) as info:
        ranks.wait(refs, timeout_s=30, what="step")
    kinds = [(f.rank, f.kind) for f in info.value.faults]
    assert kinds == [(1, "died"), (0, "error")], info.value
    assert str(info.value).startswith("step: rank 1 died: actor process is gone"), info.value


def test_an_error_with_no_death_waits_the_grace_window_only(actors):
    a, b = actors.remote(), actors.remote()
    ranks = RankSet([a, b], [], None)
    refs = {a.raise_now.remote(): 0, b.hang.remote(20.0): 1}
    t0 = time.monotonic()
    with pytest.raises(RankCallError) as info:
        ranks.wait(refs, timeout_s=30, what="step")
    took = time.monotonic() - t0
    assert [(f.rank, f.kind) for f in info.value.faults] == [(0, "error")], info.value
    assert rankset.PEER_DEATH_GRACE_S - 0.5 <= took < rankset.PEER_DEATH_GRACE_S + 5, took
    for w in (a, b):
        ray.kill(w, no_restart=True)
