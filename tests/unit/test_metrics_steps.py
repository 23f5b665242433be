"""A multi-step decode round is recorded as its decode steps in the step metrics (per-step latency, tokens)."""
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client import generate_latest

from engine.llm_engine import StepInfo
from launch.metrics import ServerMetrics


def _samples(m: ServerMetrics) -> dict:
    out = {}
    for fam in text_string_to_metric_families(generate_latest(m.registry).decode()):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_multi_step_round_counts_as_its_steps():
    m = ServerMetrics()
    m.on_step(StepInfo(0.010, ["decode"], 4, 4, num_steps=5))  # 5 steps of 2 ms over 4 sequences
    m.on_step(StepInfo(0.003, ["prefill"], 300, 2))
    s = _samples(m)
    assert s[("graphline_step_seconds_count", (("phase", "decode"),))] == 5
    assert abs(s[("graphline_step_seconds_sum", (("phase", "decode"),))] - 0.010) < 1e-9
    assert s[("graphline_scheduled_tokens_total", (("phase", "decode"),))] == 20
    assert s[("graphline_step_seconds_count", (("phase", "prefill"),))] == 1
    assert s[("graphline_scheduled_tokens_total", (("phase", "prefill"),))] == 300
