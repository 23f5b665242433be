"""Prometheus metrics (a dedicated `CollectorRegistry`) and their mirror in `ray.util.metrics`.

Two sources: engine events observed directly (step latency, time to first token, time per
output token, requests, resets, rank failures) and the latest `/status` document, turned
into metric families at scrape time (per-rank steps per path, eager reasons, capture
seconds, graph pool / bridge bytes, padded vs real tokens, queues, KV blocks, prefix cache
hits / queries / blocks / evictions, shared blocks, prefill chunks).
"""
from __future__ import annotations

import threading
from typing import Any, Iterable, Optional

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from actors.armed import OUTCOMES as ARMED_OUTCOMES
from engine.async_engine import EngineObserver
from engine.llm_engine import StepInfo
from engine.request import RequestOutput

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
STEP_BUCKETS = (0.0005, 0.001, 0.0015, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TPOT_BUCKETS = (0.0005, 0.001, 0.0015, 0.002, 0.0025, 0.003, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.1, 0.5, 1.0)


class _StatusCollector:
    """Metric families from the latest status document (set by `ServerMetrics.update_status`)."""

    def __init__(self) -> None:
        self.status: dict = {}

    def collect(self) -> Iterable[Any]:
        st = self.status
        ranks = st.get("ranks", [])

        def fam(cls, name, doc, labels):
            return cls(name, doc, labels=labels)

        steps = fam(CounterMetricFamily, "graphline_runner_steps", "Steps served per rank and path", ["rank", "path"])
        eager = fam(CounterMetricFamily, "graphline_eager_steps", "Eager steps per rank and reason", ["rank", "reason"])
        real = fam(CounterMetricFamily, "graphline_real_tokens", "Real tokens computed per rank and path",
                   ["rank", "path"])
        padded = fam(CounterMetricFamily, "graphline_padded_tokens", "Tokens computed incl. bucket padding",
                     ["rank", "path"])
        waste = fam(GaugeMetricFamily, "graphline_padding_waste_ratio", "(padded - real) / padded tokens", ["rank"])
        cap = fam(GaugeMetricFamily, "graphline_capture_seconds", "Start-up capture seconds per rank and kind",
                  ["rank", "kind"])
        capb = fam(GaugeMetricFamily, "graphline_bucket_capture_seconds", "Capture seconds per bucket",
                   ["rank", "kind", "bucket"])
        graphs = fam(GaugeMetricFamily, "graphline_captured_graphs", "Decode graphs / prefill plans / token buckets with full prefill graphs captured",
                     ["rank", "kind"])
        pool = fam(GaugeMetricFamily, "graphline_graph_pool_bytes", "CUDA graph memory pool bytes", ["rank", "kind"])
        bridge = fam(GaugeMetricFamily, "graphline_bridge_bytes", "Piecewise bridge bytes", ["rank"])
        static = fam(GaugeMetricFamily, "graphline_static_buffer_bytes", "Graph static buffer bytes", ["rank"])
        resets = fam(CounterMetricFamily, "graphline_rank_resets", "Runner resets per rank", ["rank"])
        up = fam(GaugeMetricFamily, "graphline_rank_up", "1 if the rank is alive", ["rank", "dp_rank", "tp_rank"])
        kv = fam(GaugeMetricFamily, "graphline_kv_cache_bytes", "KV cache arena bytes per rank", ["rank"])
        mem = fam(GaugeMetricFamily, "graphline_device_memory_bytes", "Device memory per rank", ["rank", "kind"])
        lane = fam(CounterMetricFamily, "graphline_decode_lane_steps",
                   "Greedy decode steps a rank's decode lane served (no runner dispatch)", ["rank"])
        armed = fam(CounterMetricFamily, "graphline_armed_decode_steps",
                    "Armed decode steps per rank by outcome: armed, went (a request took it), cancelled (padding "
                    "replayed), expired (the gate gave up first)", ["rank", "outcome"])
        for r in ranks:
            rk = str(r.get("rank", 0))
            for path, n in (r.get("steps") or {}).items():
                steps.add_metric([rk, path], n)
            for reason, n in (r.get("eager_reasons") or {}).items():
                eager.add_metric([rk, reason], n)
            tok = r.get("tokens") or {}
            for path, n in (tok.get("real") or {}).items():
                real.add_metric([rk, path], n)
            for path, n in (tok.get("padded") or {}).items():
                padded.add_metric([rk, path], n)
            waste.add_metric([rk], float(r.get("padding_waste") or 0.0))
            c = r.get("capture") or {}
            for kind in ("decode", "prefill", "prefill_graph"):
                cap.add_metric([rk, kind], float(c.get(f"{kind}_seconds_total") or 0.0))
                for b, v in (c.get(kind) or {}).items():
                    capb.add_metric([rk, kind, str(b)], float(v.get("seconds", 0.0) if isinstance(v, dict) else v))
            graphs.add_metric([rk, "decode"], float(c.get("decode_graphs") or 0))
            graphs.add_metric([rk, "prefill"], float(c.get("prefill_plans") or 0))
            graphs.add_metric([rk, "prefill_graph"], float(c.get("prefill_graphs") or 0))
            m = r.get("memory") or {}
            pool.add_metric([rk, "decode"], float(m.get("decode_graph_pool_bytes") or 0))
            pool.add_metric([rk, "piecewise"], float(m.get("piecewise_graph_pool_bytes") or 0))
            pool.add_metric([rk, "prefill_graph"], float(m.get("prefill_graph_pool_bytes") or 0))
            bridge.add_metric([rk], float(m.get("bridge_bytes") or 0))
            static.add_metric([rk], float(m.get("static_buffer_bytes") or 0))
            resets.add_metric([rk], float(r.get("resets") or 0))
            up.add_metric([rk, str(r.get("dp_rank", 0)), str(r.get("tp_rank", 0))], 1.0 if r.get("alive", True) else 0.0)
            if r.get("kv_bytes") is not None:
                kv.add_metric([rk], float(r["kv_bytes"]))
            for k in ("memory_allocated", "memory_reserved"):
                if r.get(k) is not None:
                    mem.add_metric([rk, k.split("_")[1]], float(r[k]))
            if r.get("decode_lane_steps") is not None:
                lane.add_metric([rk], float(r["decode_lane_steps"]))
            counts = r.get("armed_decode") or {}  # none: a rank that never arms (EP > 1, CPU, arming off) exports zeros
            for outcome in ARMED_OUTCOMES:
                armed.add_metric([rk, outcome], float(counts.get(outcome, 0)))
        eng = st.get("engine") or {}
        waiting = fam(GaugeMetricFamily, "graphline_requests_waiting", "Requests waiting per DP rank", ["dp_rank"])
        running = fam(GaugeMetricFamily, "graphline_requests_running", "Requests running per DP rank", ["dp_rank"])
        free = fam(GaugeMetricFamily, "graphline_kv_blocks_free", "Free KV blocks per DP rank", ["dp_rank"])
        total = fam(GaugeMetricFamily, "graphline_kv_blocks", "KV blocks per DP rank", ["dp_rank"])
        pre = fam(CounterMetricFamily, "graphline_preemptions", "Preemptions (recompute) per DP rank", ["dp_rank"])
        hits = fam(CounterMetricFamily, "graphline_prefix_cache_hits",
                   "Prompt tokens served from the prefix cache per DP rank (recomputes after preemption included)",
                   ["dp_rank"])
        queries = fam(CounterMetricFamily, "graphline_prefix_cache_queries",
                      "Prompt tokens looked up in the prefix cache per DP rank (hit rate = hits / queries)", ["dp_rank"])
        cached = fam(GaugeMetricFamily, "graphline_prefix_cache_blocks",
                     "KV blocks registered in the prefix cache per DP rank (referenced or evictable)", ["dp_rank"])
        evicted = fam(CounterMetricFamily, "graphline_prefix_cache_evictions",
                      "Cached KV blocks evicted (LRU) to make room, per DP rank", ["dp_rank"])
        shared = fam(GaugeMetricFamily, "graphline_kv_blocks_shared",
                     "KV blocks referenced by two or more sequences (shared prefixes, n > 1) per DP rank", ["dp_rank"])
        chunks = fam(CounterMetricFamily, "graphline_prefill_chunks",
                     "Intermediate prefill chunks (chunked prefill) per DP rank", ["dp_rank"])
        for i, d in enumerate(eng.get("dp_ranks", [])):
            waiting.add_metric([str(i)], d["waiting"])
            running.add_metric([str(i)], d["running"])
            free.add_metric([str(i)], d["free_kv_blocks"])
            total.add_metric([str(i)], d["num_kv_blocks"])
            pre.add_metric([str(i)], d["preemptions"])
            pc = d.get("prefix_cache") or {}
            hits.add_metric([str(i)], float(pc.get("hits", 0)))
            queries.add_metric([str(i)], float(pc.get("queries", 0)))
            cached.add_metric([str(i)], float(pc.get("cached_blocks", 0)))
            evicted.add_metric([str(i)], float(pc.get("evictions", 0)))
            shared.add_metric([str(i)], float(d.get("shared_kv_blocks", 0)))
            chunks.add_metric([str(i)], float(d.get("prefill_chunks", 0)))
        adm = st.get("admission") or {}
        held = GaugeMetricFamily("graphline_requests_in_flight", "Engine requests held (running and waiting)",
                                 value=float(adm.get("in_flight", 0)))
        bound = GaugeMetricFamily("graphline_max_concurrent_requests", "Requests held at most before 429 "
                                  "(--max-concurrent-requests; 0: no bound)", value=float(adm.get("max_in_flight", 0)))
        yield from (steps, eager, real, padded, waste, cap, capb, graphs, pool, bridge, static, resets, up, kv, mem,
                    lane, armed, waiting, running, free, total, pre, hits, queries, cached, evicted, shared, chunks,
                    held, bound)


class ServerMetrics(EngineObserver):
    """Owns the registry; an `EngineObserver` (engine thread) and the status collector (scrape time)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.step_seconds = Histogram("graphline_step_seconds", "Executor step latency seen by the engine", ["phase"],
                                      buckets=STEP_BUCKETS, registry=r)
        self.step_tokens = Counter("graphline_scheduled_tokens", "Tokens scheduled per phase", ["phase"], registry=r)
        self.ttft = Histogram("graphline_time_to_first_token_seconds", "Arrival to first token", buckets=TTFT_BUCKETS,
                              registry=r)
        self.tpot = Histogram("graphline_time_per_output_token_seconds", "Mean interval between output tokens",
                              buckets=TPOT_BUCKETS, registry=r)
        self.latency = Histogram("graphline_request_latency_seconds", "Arrival to last token", buckets=TTFT_BUCKETS,
                                 registry=r)
        self.requests = Counter("graphline_requests", "Finished requests by finish reason", ["finish_reason"],
                                registry=r)
        self.http = Counter("graphline_http_requests", "HTTP requests by endpoint and status", ["endpoint", "status"],
                            registry=r)
        self.prompt_tokens = Counter("graphline_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("graphline_generation_tokens", "Generated tokens of finished requests",
                                         registry=r)
        self.resets = Counter("graphline_resets", "Resets (re-capture of every rank)", registry=r)
        self.rank_failures = Counter("graphline_rank_failures", "Executor failures (a rank died or timed out)",
                                     registry=r)
        self.structured = Counter("graphline_structured_requests", "Accepted requests with a grammar (response_format "
                                  "or structured_outputs) by kind", ["kind"], registry=r)
        self.status_collector = _StatusCollector()
        r.register(self.status_collector)
        self.ray = RayMetricsMirror.create()
        self._lock = threading.Lock()

    # ---- EngineObserver (engine thread)
    def on_step(self, info: StepInfo) -> None:
        phase = info.kind
        per_step = info.seconds / info.num_steps  # a multi-step decode round counts as its steps
        for _ in range(info.num_steps):
            self.step_seconds.labels(phase).observe(per_step)
        self.step_tokens.labels(phase).inc(info.num_tokens * info.num_steps)
        if self.ray:
            self.ray.observe("graphline_step_seconds", per_step, {"phase": phase})

    def on_request_finished(self, out: RequestOutput) -> None:
        reason = out.finish_reason.value if out.finish_reason else "unknown"
        self.requests.labels(reason).inc()
        self.prompt_tokens.inc(out.num_prompt_tokens)
        self.generation_tokens.inc(len(out.token_ids))
        ttft, tpot = out.time_to_first_token, out.time_per_output_token
        if ttft is not None:
            self.ttft.observe(ttft)
        if tpot is not None:
            self.tpot.observe(tpot)
        if out.finish_time is not None:
            self.latency.observe(out.finish_time - out.arrival_time)
        if self.ray:
            self.ray.inc("graphline_requests", 1, {"finish_reason": reason})
            self.ray.inc("graphline_generation_tokens", len(out.token_ids))
            if ttft is not None:
                self.ray.observe("graphline_time_to_first_token_seconds", ttft)
            if tpot is not None:
                self.ray.observe("graphline_time_per_output_token_seconds", tpot)

    def on_reset(self, result: dict) -> None:
        self.resets.inc()
        if self.ray:
            self.ray.inc("graphline_resets", 1)

    def on_failure(self, message: str) -> None:
        self.rank_failures.inc()
        if self.ray:
            self.ray.inc("graphline_rank_failures", 1)

    # ---- scrape
    def update_status(self, status: dict) -> None:
        self.status_collector.status = status
        if self.ray:
            self.ray.set_status(status)

    def http_request(self, endpoint: str, status: int) -> None:
        self.http.labels(endpoint, str(status)).inc()

    def structured_request(self, kind: str) -> None:
        self.structured.labels(kind).inc()

    def exposition(self) -> bytes:
        with self._lock:
            return generate_latest(self.registry)


class RayMetricsMirror:
    """The same figures through `ray.util.metrics` (exported by Ray's metrics agent) when Ray is initialised."""

    @staticmethod
    def create() -> Optional["RayMetricsMirror"]:
        try:
            import ray

            if not ray.is_initialized():
                return None
            return RayMetricsMirror()
        except Exception:  # noqa: BLE001 - Ray metrics are best effort
            return None

    def __init__(self) -> None:
        from ray.util import metrics as m

        self._m = m
        self._hist = {
            "graphline_step_seconds": m.Histogram("graphline_step_seconds", "Executor step latency",
                                                  boundaries=list(STEP_BUCKETS), tag_keys=("phase",)),
            "graphline_time_to_first_token_seconds": m.Histogram("graphline_time_to_first_token_seconds", "TTFT",
                                                                 boundaries=list(TTFT_BUCKETS)),
            "graphline_time_per_output_token_seconds": m.Histogram("graphline_time_per_output_token_seconds", "TPOT",
                                                                   boundaries=list(TPOT_BUCKETS)),
        }
        self._counters = {
            "graphline_requests": m.Counter("graphline_requests", "Finished requests", tag_keys=("finish_reason",)),
            "graphline_generation_tokens": m.Counter("graphline_generation_tokens", "Generated tokens"),
            "graphline_resets": m.Counter("graphline_resets", "Resets"),
            "graphline_rank_failures": m.Counter("graphline_rank_failures", "Executor failures"),
        }
        self._gauges: dict[str, Any] = {}

    def observe(self, name: str, value: float, tags: Optional[dict] = None) -> None:
        try:
            self._hist[name].observe(value, tags=tags)
        except Exception:  # noqa: BLE001
            pass

    def inc(self, name: str, value: float, tags: Optional[dict] = None) -> None:
        try:
            if value > 0:
                self._counters[name].inc(value, tags=tags)
        except Exception:  # noqa: BLE001
            pass

    def set_status(self, status: dict) -> None:
        """Per-rank figures as Ray gauges (cumulative step counts are exported as their current value)."""
        try:
            for fam in _StatusCollector.collect(type("S", (), {"status": status})()):
                for s in fam.samples:
                    name = s.name if fam.type == "gauge" else fam.name
                    g = self._gauges.get(name)
                    if g is None:
                        g = self._m.Gauge(name, fam.documentation, tag_keys=tuple(s.labels))
                        self._gauges[name] = g
                    g.set(float(s.value), tags=dict(s.labels))
        except Exception:  # noqa: BLE001
            pass
