"""Prometheus metrics of the server (`GET /metrics`), and the hook for per-request tables.

Two sources feed the series:

- the HTTP layer, for every request: requests by model, endpoint and status; latency, time
  to first token (TTFT), time to first audio packet (TTFP) and real-time factor (RTF)
  histograms; requests in flight and the admission limit;
- `engine.inspect()`, read at scrape time: how many requests each stage holds (queue
  depth); each stage's steps as histograms of their batch size and time (the `--log-stats`
  names: `batch_size`, `stage_gen_time`); each edge's chunks, bytes and put time, chunks
  waiting for credits, ring slots held (occupancy), and a histogram of its chunks' time
  from put to take (hand-off: `in_flight_time`). The executors count those histograms
  into fixed buckets as they run (control.py); a scrape only reads them.

`PipelineStats` (one per served pipeline) keeps each request's per-stage and per-edge
tables, which the engine hands over under `--log-stats`, until the request's HTTP handler
takes them.

Every series has a `model` label: the served pipeline's name.
"""

from __future__ import annotations

import itertools
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)
from prometheus_client.utils import floatToGoString

from omniflow.plan import FRONTEND
from omniflow.runtime.control import BATCH_BOUNDS, HANDOFF_NS_BOUNDS, STEP_NS_BOUNDS

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
RTF_BUCKETS = (0.05, 0.1, 0.25, 0.5, 0.75, 1, 1.5, 2, 4, 8, 16)
# Underrun: 0 (gapless) is the goal; 0.1 s a listener barely notices, seconds it does.
UNDERRUN_BUCKETS = (0.0, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
INSPECT_TIMEOUT_S = 2.0  # a scrape does not wait longer for the executors' answer


class Metrics:
    """The server's registry (one per app, so several apps in one process do not clash)."""

    def __init__(self):
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "omniflow_requests",
            "HTTP requests answered, by served pipeline (model), endpoint and status code",
            ["model", "endpoint", "status"],
            registry=r,
        )
        self.latency = Histogram(
            "omniflow_request_duration_seconds",
            "Time from a request's arrival to its last byte (end to end), by model and endpoint",
            ["model", "endpoint"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "omniflow_time_to_first_token_seconds",
            "Time from a request's arrival to the first text its pipeline produced (TTFT)",
            ["model"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.ttfp = Histogram(
            "omniflow_time_to_first_audio_packet_seconds",
            "Time from a request's arrival to the first audio chunk its pipeline produced (TTFP)",
            ["model"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.rtf = Histogram(
            "omniflow_real_time_factor",
            "End-to-end time over the duration of the audio a request produced "
            "(below 1: faster than real time)",
            ["model"],
            buckets=RTF_BUCKETS,
            registry=r,
        )
        self.underrun = Histogram(
            "omniflow_playback_underrun_seconds",
            "Seconds a listener who starts playing a reply's audio at its first packet waits "
            "for later packets, per reply with audio",
            ["model"],
            buckets=UNDERRUN_BUCKETS,
            registry=r,
        )
        self.audio_seconds = Counter(
            "omniflow_audio_output_seconds",
            "Seconds of audio the served pipelines produced",
            ["model"],
            registry=r,
        )
        self.text_tokens = Counter(
            "omniflow_text_output_tokens",
            "Text tokens the served pipelines produced (as their stages counted them)",
            ["model"],
            registry=r,
        )
        self.in_flight = Gauge(
            "omniflow_requests_in_flight",
            "Requests admitted and not finished, by model",
            ["model"],
            registry=r,
        )
        self.queued = Gauge(
            "omniflow_requests_queued",
            "Requests admitted and waiting for a slot (the bounded admission queue), by model",
            ["model"],
            registry=r,
        )
        self.queue_wait = Histogram(
            "omniflow_queue_wait_seconds",
            "Time a request waited in the admission queue for a slot (0 when one was free)",
            ["model"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.admission_limit = Gauge(
            "omniflow_admission_limit",
            "Requests a served pipeline admits at once; beyond it the server answers 503",
            ["model"],
            registry=r,
        )
        self.voice_encodes = Counter(
            "omniflow_voice_encodes",
            "Reference clips encoded into voice prompts (an upload, or a request's inline "
            "ref_audio; a request naming an uploaded voice encodes nothing), by model",
            ["model"],
            registry=r,
        )
        self.websocket_sessions = Gauge(
            "omniflow_websocket_sessions",
            "WebSocket sessions open now, by model and endpoint (/v1/audio/speech/stream, "
            "/v1/realtime)",
            ["model", "endpoint"],
            registry=r,
        )
        self.served: dict[str, object] = {}  # model -> Served, for the inspection collector
        r.register(_InspectionCollector(self))

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def observe_request(self, model: str, endpoint: str, status: int, seconds: float) -> None:
        self.requests.labels(model, endpoint, str(status)).inc()
        if status < 400:
            self.latency.labels(model, endpoint).observe(seconds)


class _InspectionCollector:
    """Series read from each served pipeline's `engine.inspect()` at scrape time."""

    def __init__(self, metrics: Metrics):
        self.metrics = metrics

    def describe(self):
        return []  # the families depend on the served pipelines: collected at scrape time

    def collect(self):
        stage, edge, model_label = ["model", "stage"], ["model", "edge"], ["model"]
        families = {
            "depth": GaugeMetricFamily(
                "omniflow_stage_queue_depth",
                "Requests a stage holds now (admitted to it, not finished), from engine.inspect()",
                labels=stage,
            ),
            "batch": HistogramMetricFamily(
                "omniflow_stage_batch_size",
                "Requests in one step of a stage (batch_size), per step, from engine.inspect()",
                labels=stage,
            ),
            "gen": HistogramMetricFamily(
                "omniflow_stage_gen_time_seconds",
                "Time one step of a stage took, the whole batch (stage_gen_time), per step, "
                "from engine.inspect()",
                labels=stage,
            ),
            "chunks": CounterMetricFamily(
                "omniflow_edge_chunks",
                "Chunks written onto an edge between executors, from engine.inspect()",
                labels=edge,
            ),
            "bytes": CounterMetricFamily(
                "omniflow_edge_bytes",
                "Bytes written onto an edge between executors, from engine.inspect()",
                labels=edge,
            ),
            "put_s": CounterMetricFamily(
                "omniflow_edge_put_seconds",
                "Time writing chunks onto an edge took (the sender's side of the hand-off), "
                "from engine.inspect()",
                labels=edge,
            ),
            "queued": GaugeMetricFamily(
                "omniflow_edge_queued_chunks",
                "Chunks waiting for an edge's ring credits now, from engine.inspect()",
                labels=edge,
            ),
            "held": GaugeMetricFamily(
                "omniflow_ring_held_slots",
                "Slots of an edge's shared-memory ring its consumer holds now, from engine.inspect()",
                labels=edge,
            ),
            "occupancy": GaugeMetricFamily(
                "omniflow_ring_occupancy_ratio",
                "Fraction of an edge's ring slots its consumer holds now, from engine.inspect()",
                labels=edge,
            ),
            "in_flight": HistogramMetricFamily(
                "omniflow_edge_in_flight_time_seconds",
                "Time from a chunk's put on an edge between executors to its consumer's take "
                "(the hand-off: in_flight_time), per chunk, from engine.inspect()",
                labels=edge,
            ),
            "requests": GaugeMetricFamily(
                "omniflow_engine_requests",
                "Requests a served pipeline's engine holds now, from engine.inspect()",
                labels=model_label,
            ),
            "up": GaugeMetricFamily(
                "omniflow_engine_up",
                "1 when a served pipeline's executors answered an inspection at this scrape",
                labels=model_label,
            ),
        }
        for model, served in list(self.metrics.served.items()):
            try:
                found = served.engine.inspect(timeout=INSPECT_TIMEOUT_S)
            except Exception:  # a scrape reports a stuck or closed engine, it does not fail
                families["up"].add_metric([model], 0)
                continue
            families["up"].add_metric([model], 1)
            slots = {c.name: c.slots for c in served.plan.channels}
            for executor, inspection in found.items():
                for name, calls in inspection.calls.items():
                    if executor == FRONTEND:
                        families["requests"].add_metric([model], len(calls))
                    else:
                        families["depth"].add_metric([model, name], len(calls))
                for name, totals in getattr(inspection, "stages", {}).items():
                    families["batch"].add_metric(
                        [model, name], _cumulative(BATCH_BOUNDS, totals.batches), totals.calls
                    )
                    families["gen"].add_metric(
                        [model, name],
                        _cumulative(STEP_NS_BOUNDS, totals.times, 1e-9),
                        totals.step_ns / 1e9,
                    )
                for name, totals in getattr(inspection, "channels", {}).items():
                    families["chunks"].add_metric([model, name], totals.chunks)
                    families["bytes"].add_metric([model, name], totals.bytes)
                    families["put_s"].add_metric([model, name], totals.put_ns / 1e9)
                    families["queued"].add_metric([model, name], totals.queued)
                for name, totals in getattr(inspection, "handoffs", {}).items():
                    families["in_flight"].add_metric(
                        [model, name],
                        _cumulative(HANDOFF_NS_BOUNDS, totals.times, 1e-9),
                        totals.ns / 1e9,
                    )
                for name, held in getattr(inspection, "held", {}).items():
                    families["held"].add_metric([model, name], held)
                    if slots.get(name):
                        families["occupancy"].add_metric([model, name], held / slots[name])
        yield from families.values()


def _cumulative(bounds: tuple, counts: list[int], scale: float = 1) -> list[tuple[str, int]]:
    """Per-bucket counts (the last one: beyond every bound) as Prometheus buckets: each
    bound (times `scale`, so ns become seconds) with the count at or below it."""
    les = [floatToGoString(bound * scale) for bound in bounds] + ["+Inf"]
    return list(zip(les, itertools.accumulate(counts), strict=True))


@dataclass
class RequestStats:
    """One request's per-stage and per-edge figures, as `--log-stats` prints them."""

    stages: dict[str, dict] = field(default_factory=dict)
    edges: dict[str, dict] = field(default_factory=dict)


class PipelineStats:
    """Per-request tables of one served pipeline, for `--log-stats`: the engine calls the
    object with each request's `control.RequestStats` (from its I/O thread) before the
    request's last chunk; the request's HTTP handler `take`s them when it ends."""

    KEEP = 4096  # requests whose tables wait for their HTTP request to take them

    def __init__(self):
        self._lock = threading.Lock()
        self._requests: OrderedDict[str, RequestStats] = OrderedDict()

    def __call__(self, stats) -> None:
        with self._lock:
            kept = self._requests.get(stats.request_id)
            if kept is None:
                kept = self._requests[stats.request_id] = RequestStats()
                while len(self._requests) > self.KEEP:
                    self._requests.popitem(last=False)
            kept.stages.update({k: dict(v) for k, v in stats.stages.items()})
            kept.edges.update({k: dict(v) for k, v in stats.edges.items()})

    def take(self, request_id: str) -> RequestStats:
        """A finished request's tables (empty where the runtime reported nothing)."""
        with self._lock:
            return self._requests.pop(request_id, None) or RequestStats()
