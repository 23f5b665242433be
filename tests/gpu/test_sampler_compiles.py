"""No sampler kernel compiles mid-serving: after the start-up warm-up (`modeling.sampler.warm_up`), eager sampling
of any batch size, variant and logprob count launches only kernels already compiled.

Counted on the Triton JIT functions' in-process caches (one entry per compiled specialisation), each check in a
fresh child process (a test process may have compiled them already): the warm-up adds entries; then sampling
batches 1-70 (among them the classes that used to compile binaries of their own: 3, 15, 17-31, 33-63, next to
the multiples of 16 the decode heads capture) with every variant (the processed ones with and without an allow
mask) and logprob counts 0-20 adds none. The second
check runs a rank's start-up (`RankRuntime.build_runner`) instead of the bare warm-up.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]

_CHILD = r"""
import json, sys, time
import numpy as np
import torch
from modeling.sampler import HostBatch, SamplerParams, sample
from modeling.sampler.allow_bits import mask_words
from modeling.sampler import triton_kernels as tk, triton_select as tsel
from modeling.sampler.warm_up import warm_up_classes, warm_up_row, warm_up_sampler

V = 151936
CAPS = dict(max_bias=8, max_ban=4, max_penalty_tokens=32)
BATCHES = (1, 2, 3, 5, 8, 13, 15, 16, 17, 23, 31, 32, 37, 48, 63, 64, 70)
LOGPROBS = (0, 1, 3, 5, 8, 20)


def compiled():
    fns = [o for m in (tk, tsel) for o in vars(m).values() if hasattr(o, "device_caches")]
    return sum(len(entry[0]) for fn in fns for entry in fn.device_caches.values())


def sweep(logits, params, vocab):
    lay = params.layout
    caps = dict(max_bias=lay.max_bias, max_ban=lay.max_ban, max_penalty_tokens=lay.max_pen)
    calls = 0
    for variant in dict.fromkeys(v for v, _ in warm_up_classes()):
        for masked in (False, True) if variant.processed else (False,):  # allow masks ride on processed steps
            for b in BATCHES:
                bits = np.full((b, mask_words(vocab)), -1, np.int32) if masked else None
                params.load(HostBatch.from_rows([warm_up_row(variant, vocab)] * b, vocab_size=vocab, **caps,
                                                allow_bits=bits), rows=b)
                for n in LOGPROBS:
                    out = sample(logits[:b], params, num_logprobs=n, variant=variant)
                    assert out.tokens.shape == (b,) and out.top_ids.shape == (b, n)
                    calls += 1
    torch.cuda.synchronize()
    return calls


mode = sys.argv[1]
before = compiled()
if mode == "bare":
    logits = torch.randn(max(BATCHES), V, device="cuda") * 3
    params = SamplerParams(max(BATCHES), "cuda", **CAPS)
    t0 = time.perf_counter()
    launches = warm_up_sampler(logits[:1], params, V)
    torch.cuda.synchronize()
    warm_up_s = time.perf_counter() - t0
    vocab = V
else:
    from tests.gpu.helpers import make_runtime
    rt = make_runtime(blocks=64, capture=False, max_decode_batch=8, pcg_max_tokens=0)
    launches = -1
    vocab = rt.model_config.vocab_size
    logits = torch.randn(max(BATCHES), vocab, device="cuda")
    params = rt.sampler()._params_for(max(BATCHES))  # the rank's list layout (the patch kernel's constants)
    warm_up_s = rt.timings.get("sampler_warm_up_s")
torch.cuda.synchronize()
warmed = compiled()
calls = sweep(logits, params, vocab)
print("RESULT" + json.dumps({"before": before, "warmed": warmed, "after": compiled(), "calls": calls,
                             "launches": launches, "warm_up_s": warm_up_s, "classes": len(warm_up_classes())}))
"""


def _run(mode: str) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p))
    proc = subprocess.run([sys.executable, "-c", _CHILD, mode], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=900)
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT")]
    assert proc.returncode == 0 and line, proc.stderr[-4000:]
    result = json.loads(line[-1][len("RESULT"):])
    print(mode, result)  # the warm-up's figures, for the log (`pytest -s`)
    return result


def test_eager_sampling_after_the_warm_up_compiles_nothing():
    r = _run("bare")
    assert r["launches"] == r["classes"] == 36 and r["warmed"] > r["before"] == 0, r
    assert r["calls"] == (12 + 6) * 17 * 6, r  # the 6 processed variants also with allow masks
    assert r["after"] == r["warmed"], f"{r['after'] - r['warmed']} sampler kernels compiled after the warm-up: {r}"


def test_a_rank_start_up_leaves_nothing_for_its_eager_sampler_to_compile():
    r = _run("rank")
    assert r["warmed"] > r["before"] == 0, r
    assert r["after"] == r["warmed"], f"{r['after'] - r['warmed']} sampler kernels compiled after start-up: {r}"
