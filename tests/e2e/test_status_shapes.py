"""`/status` normalisation and the Prometheus exposition for both executor status shapes (coordinator and
local), without a server: the dashboard and the collector read one shape."""
from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from launch.metrics import ServerMetrics
from launch.status import build_status

RUNNER = {"steps": {"full_graph": 7, "piecewise": 2, "eager": 1}, "eager_reasons": {"batch_too_large": 1},
          "tokens": {"real": {"full_graph": 20, "piecewise": 100, "eager": 3},
                     "padded": {"full_graph": 28, "piecewise": 512, "eager": 3}, "real_total": 123,
                     "padded_total": 543, "padding_waste": 0.77},
          "capture": {"decode": {"8": {"seconds": 0.2, "graph": True}, "4": {"seconds": 0.1, "graph": True}},
                      "prefill": {"512": {"seconds": 1.5, "graph": True}}, "decode_seconds_total": 0.3,
                      "prefill_seconds_total": 1.5, "decode_graphs": 2, "prefill_plans": 1},
          "memory": {"decode_graph_pool_bytes": 1 << 20, "piecewise_graph_pool_bytes": 2 << 20,
                     "bridge_bytes": 4096, "static_buffer_bytes": 512}, "resets": 1}

COORDINATOR = {  # actors.startup.summarize_status
    "state": "serving", "topology": {"world": 2, "tp": 2, "dp": 1, "ep": 1}, "step_path": "compiled",
    "phases": {"decode": 7, "prefill": 3}, "steps": 10, "resets": 1, "failures": 0,
    "overhead": {"coordinator_ms_mean": 0.2, "in_rank_step_ms_mean": 1.1},
    "ranks": [{"rank": r, "dp_rank": 0, "tp_rank": r, "ep_rank": 0, "alive": True, "pid": 100 + r, "device": f"cuda:{r}",
               "steps": 10, "runner": RUNNER, "capture": RUNNER["capture"], "kv_blocks": 100, "kv_bytes": 1 << 24,
               "memory": {"memory_allocated": 5 << 30, "memory_reserved": 6 << 30}, "decode_lane_steps": 5 + r,
               "armed_decode": {"armed": 4, "went": 3, "cancelled": 1, "expired": 0} if r == 0 else None}
              for r in range(2)],
}
ENGINE = {"dp_ranks": [{"waiting": 1, "running": 2, "free_kv_blocks": 50, "num_kv_blocks": 100, "preemptions": 3}]}


def test_coordinator_status_normalises_per_rank():
    st = build_status(COORDINATOR, ENGINE, {"model": "m"}, [], [])
    assert st["state"] == "serving" and st["phases"] == {"decode": 7, "prefill": 3} and st["num_resets"] == 1
    assert st["step_path"] == "compiled" and st["overhead"]["coordinator_ms_mean"] == 0.2
    r = st["ranks"][1]
    assert r["rank"] == 1 and r["tp_rank"] == 1 and r["rank_steps"] == 10
    assert r["steps"] == RUNNER["steps"] and r["memory"] == RUNNER["memory"]  # runner memory, not device memory
    assert r["memory_allocated"] == 5 << 30 and r["plans"] == {"decode": [4, 8], "prefill": [512]}
    assert r["padding_waste"] == 0.77


def test_local_status_shape_and_engine_logs():
    local = {"state": "serving", "ranks": [{"rank": 0, "device": "cpu", "runner": RUNNER, "kv_blocks": 10}],
             "resets": [{"time": 1.0, "total_s": 0.1}], "failures": 0}
    st = build_status(local, ENGINE, {}, [{"time": 2.0}], [{"time": 3.0, "message": "x"}])
    assert st["num_resets"] == 1 and st["resets"] == [{"time": 1.0, "total_s": 0.1}]
    assert st["failures"] == [{"time": 3.0, "message": "x"}] and st["num_failures"] == 1
    assert st["ranks"][0]["dp_rank"] == 0 and st["ranks"][0]["steps"]["full_graph"] == 7


def test_exposition_from_a_coordinator_status():
    m = ServerMetrics()
    m.update_status(build_status(COORDINATOR, ENGINE, {}, [], []))
    fams = {f.name: f for f in text_string_to_metric_families(m.exposition().decode())}
    steps = {(s.labels["rank"], s.labels["path"]): s.value for s in fams["graphline_runner_steps"].samples
             if s.name.endswith("_total")}
    assert steps[("1", "full_graph")] == 7 and steps[("0", "eager")] == 1
    pool = {(s.labels["rank"], s.labels["kind"]): s.value for s in fams["graphline_graph_pool_bytes"].samples}
    assert pool[("0", "piecewise")] == 2 << 20
    dev = {(s.labels["rank"], s.labels["kind"]): s.value for s in fams["graphline_device_memory_bytes"].samples}
    assert dev[("1", "allocated")] == 5 << 30
    assert [s.value for s in fams["graphline_requests_waiting"].samples] == [1]
    assert {s.labels["bucket"] for s in fams["graphline_bucket_capture_seconds"].samples} == {"4", "8", "512"}
    lane = {s.labels["rank"]: s.value for s in fams["graphline_decode_lane_steps"].samples if s.name.endswith("_total")}
    assert lane == {"0": 5, "1": 6}
    armed = {(s.labels["rank"], s.labels["outcome"]): s.value for s in fams["graphline_armed_decode_steps"].samples
             if s.name.endswith("_total")}
    assert {k: v for k, v in armed.items() if k[0] == "0"} == {("0", "armed"): 4, ("0", "went"): 3,
                                                               ("0", "cancelled"): 1, ("0", "expired"): 0}
    assert {k: v for k, v in armed.items() if k[0] == "1"} == {("1", o): 0 for o in ("armed", "went", "cancelled",
                                                                                      "expired")}  # never arms
    # An empty status (before the first scrape) still exposes valid text.
    m.update_status({})
    list(text_string_to_metric_families(m.exposition().decode()))
