"""Prometheus metrics of one server (``GET /metrics``).

Each app owns its own CollectorRegistry (several apps in one process, as in tests, never share
counts). Request-path metrics are recorded as requests run; engine-state gauges (queue depth, running
requests, KV pages, state slots) are read from ``Engine.stats()`` at scrape time by a collector, so
they are never stale and cost nothing between scrapes.

Names (all prefixed ``ninfer_``): see docs/http.md.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Seconds. TTFT spans queueing and prefill; inter-token latency is one decode step.
_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5)
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)


class EngineCollector(Collector):
    """Engine state at scrape time."""

    def __init__(self, stats: Callable[[], Any]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Any]:
        s = self._stats()

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            return GaugeMetricFamily(f"ninfer_{name}", doc, value=value)

        yield gauge("engine_up", "1 while the engine accepts requests", 1.0 if s.status == "running" else 0.0)
        yield gauge("queue_depth", "requests waiting for admission", s.queue_depth)
        yield gauge("requests_running", "requests resident in the engine (prefill or decode)", s.running)
        yield gauge("requests_paused", "preempted requests waiting to resume", s.paused)
        yield gauge("requests_outstanding", "submitted requests holding capacity", s.outstanding)
        yield gauge("kv_pages_used", "KV cache pages in use", s.pages_used)
        yield gauge("kv_pages_total", "KV cache pages", s.pages_total)
        yield gauge("kv_usage_ratio", "fraction of KV cache pages in use",
                    s.pages_used / s.pages_total if s.pages_total else 0.0)
        yield gauge("state_slots_used", "recurrent-state slots in use", s.state_slots_used)
        yield gauge("state_slots_total", "recurrent-state slots", s.state_slots_total)
        yield gauge("state_usage_ratio", "fraction of recurrent-state slots in use",
                    s.state_slots_used / s.state_slots_total if s.state_slots_total else 0.0)
        yield gauge("max_step_chunks", "the most prefill/Replay chunks one engine step has run",
                    getattr(s, "max_unit_chunks", 0))
        yield gauge("context_cache_checkpoints", "context-cache checkpoints held", getattr(s, "cache_checkpoints", 0))
        yield gauge("context_cache_device_bytes", "device bytes held by the context cache (StateImages + KV pages "
                    "only it references)", getattr(s, "cache_device_bytes", 0))
        yield gauge("context_cache_host_bytes", "host bytes held by the context cache", getattr(s, "cache_host_bytes", 0))
        yield gauge("context_cache_host_checkpoints", "context-cache checkpoints with content on Host",
                    getattr(s, "cache_host_checkpoints", 0))
        yield gauge("context_cache_host_budget_bytes", "the context cache's Host tier budget (0: no Host tier)",
                    getattr(s, "cache_host_budget_bytes", 0))
        for name, doc in (("context_cache_hit_tokens", "prompt tokens restored from context-cache checkpoints"),
                          ("context_cache_saved_prefill_tokens", "prefill tokens not computed thanks to the context cache"),
                          ("context_cache_demotions", "context-cache checkpoints moved from Device to Host"),
                          ("context_cache_restores", "context-cache checkpoints moved from Host back to Device for a hit"),
                          ("context_cache_evictions", "context-cache checkpoints dropped under pressure"),
                          ("context_cache_host_evictions", "context-cache checkpoints dropped from Host for its budget")):
            yield CounterMetricFamily(f"ninfer_{name}", doc, value=getattr(s, name.replace("context_", ""), 0))
        for name, doc in (("snapshot_pauses", "preemptions that kept a Snapshot (resume without recomputation)"),
                          ("snapshot_resumes", "resumes from a Snapshot"),
                          ("snapshot_revocations", "Snapshots revoked under pressure (the request replays)"),
                          ("replays", "resumes that recompute the request's history (Replay)"),
                          ("lookahead_launched", "decode steps launched before the previous step's tokens reached "
                                                 "the host (lookahead decode)"),
                          ("lookahead_adopted", "lookahead decode steps the next unit used"),
                          ("lookahead_dropped", "lookahead decode steps dropped (the next unit asked for other work)"),
                          ("chunks", "prefill and Replay chunks run (several requests' chunks may share one step)")):
            yield CounterMetricFamily(f"ninfer_{name}", doc, value=getattr(s, name, 0))
        for name, doc in (("preemptions", "requests paused to free capacity"),
                          ("prefill_tokens", "prompt tokens computed by the engine"),
                          ("engine_cancelled", "requests the engine ended as cancelled")):
            value = getattr(s, "cancelled" if name == "engine_cancelled" else name)
            yield CounterMetricFamily(f"ninfer_{name}", doc, value=value)
        for name, field, doc in (
                ("spec_drafted_tokens", "spec_drafted", "tokens drafted and verified by speculative decoding"),
                ("spec_accepted_tokens", "spec_accepted", "drafted tokens the target accepted"),
                ("spec_verify_steps", "spec_verifies", "speculative verify rows run (one per speculating "
                                                        "request per step)")):
            yield CounterMetricFamily(f"ninfer_{name}", doc, value=getattr(s, field, 0))
        # Per draft position (ninfer.engine.stats): accepted / drafted of one position is its acceptance rate.
        for name, doc in (
                ("spec_drafted_by_position", "speculative verify rows that drafted at least `position` tokens"),
                ("spec_accepted_by_position", "speculative verify rows whose draft at `position` was accepted "
                                              "(and every draft before it)")):
            family = CounterMetricFamily(f"ninfer_{name}", doc, labels=("position",))
            for position, value in enumerate(getattr(s, name, ()), start=1):
                family.add_metric((str(position),), value)
            yield family
        # Per MoE layer with a device cache of host experts (docs/memory.md): hits / (hits + misses) is its rate.
        for name, doc in (("expert_cache_hits", "routed (token, expert) pairs computed from the device expert cache"),
                          ("expert_cache_misses", "routed (token, expert) pairs computed on the host")):
            family = CounterMetricFamily(f"ninfer_{name}", doc, labels=("layer",))
            for layer, value in enumerate(getattr(s, name, ())):
                family.add_metric((str(layer),), value)
            yield family


class ServerMetrics:
    def __init__(self, stats: Callable[[], Any]) -> None:
        # ``*_created`` series double the exposition and no dashboard uses them (process-wide switch).
        disable_created_metrics()
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("ninfer_requests", "generation requests by endpoint and outcome",
                                ("endpoint", "outcome"), registry=r)
        self.prompt_tokens = Counter("ninfer_prompt_tokens", "prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("ninfer_generation_tokens", "tokens generated", registry=r)
        self.ttft = Histogram("ninfer_time_to_first_token_seconds",
                              "arrival at the server to the first generated token", buckets=_TTFT_BUCKETS,
                              registry=r)
        self.itl = Histogram("ninfer_inter_token_latency_seconds",
                             "time between successive token events of a request (one decode step)",
                             buckets=_ITL_BUCKETS, registry=r)
        self.e2e = Histogram("ninfer_request_duration_seconds", "arrival to the end of a generation request",
                             buckets=_E2E_BUCKETS, registry=r)
        r.register(EngineCollector(stats))

    def count(self, endpoint: str, outcome: str) -> None:
        self.requests.labels(endpoint=endpoint, outcome=outcome).inc()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
