"""Prometheus metrics of the server (`GET /metrics`), and the hook the runtime feeds.

Three sources feed the series:

- the HTTP layer, for every request: requests by model, endpoint and status; latency, time
  to first token (TTFT), time to first audio packet (TTFP) and real-time factor (RTF)
  histograms; requests in flight and the admission limit;
- `engine.inspect()`, read at scrape time: how many requests each stage holds (queue
  depth); each stage's steps, their time and the requests they advanced (their ratio is the
  mean batch size); each edge's chunks, bytes and put time, chunks waiting for credits,
  and ring slots held (occupancy);
- `PipelineStats`, the hook the runtime calls as it runs (one per served pipeline): each
  stage step (batch size, step time histograms), each hand-off on an edge (time
  histogram), and per-request stage and edge tables for `--log-stats`. Until the engine
  calls it, those series exist (with their HELP text) and stay empty.

Every series has a `model` label: the served pipeline's name.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from omniflow.plan import FRONTEND

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
RTF_BUCKETS = (0.05, 0.1, 0.25, 0.5, 0.75, 1, 1.5, 2, 4, 8, 16)
STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 5)
HANDOFF_BUCKETS = (1e-5, 5e-5, 1e-4, 5e-4, 1e-3, 5e-3, 0.01, 0.05, 0.1, 0.5, 1)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
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
        self.audio_seconds = Counter(
            "omniflow_audio_output_seconds",
            "Seconds of audio the served pipelines produced",
            ["model"],
            registry=r,
        )
        self.text_tokens = Counter(
            "omniflow_text_output_tokens",
            "Text chunks (tokens) the served pipelines produced",
            ["model"],
            registry=r,
        )
        self.in_flight = Gauge(
            "omniflow_requests_in_flight",
            "Requests admitted and not finished, by model",
            ["model"],
            registry=r,
        )
        self.admission_limit = Gauge(
            "omniflow_admission_limit",
            "Requests a served pipeline admits at once; beyond it the server answers 503",
            ["model"],
            registry=r,
        )
        # Fed by PipelineStats (the runtime's hook).
        self.stage_batch = Histogram(
            "omniflow_stage_batch_size",
            "Requests in one step of a stage, per step (runtime stats hook)",
            ["model", "stage"],
            buckets=BATCH_BUCKETS,
            registry=r,
        )
        self.stage_step = Histogram(
            "omniflow_stage_step_duration_seconds",
            "Duration of one step of a stage, the whole batch (runtime stats hook)",
            ["model", "stage"],
            buckets=STEP_BUCKETS,
            registry=r,
        )
        self.edge_handoff = Histogram(
            "omniflow_edge_handoff_seconds",
            "Time from a chunk's write on an edge to its read by the consumer (runtime stats hook)",
            ["model", "edge"],
            buckets=HANDOFF_BUCKETS,
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
            "steps": CounterMetricFamily(
                "omniflow_stage_steps", "Steps a stage has run, from engine.inspect()", labels=stage
            ),
            "step_s": CounterMetricFamily(
                "omniflow_stage_step_seconds",
                "Time a stage's steps took, from engine.inspect()",
                labels=stage,
            ),
            "batched": CounterMetricFamily(
                "omniflow_stage_batched_requests",
                "Requests a stage's steps advanced, summed over steps (over steps: the mean "
                "batch size), from engine.inspect()",
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
                    families["steps"].add_metric([model, name], totals.steps)
                    families["step_s"].add_metric([model, name], totals.step_ns / 1e9)
                    families["batched"].add_metric([model, name], totals.calls)
                for name, totals in getattr(inspection, "channels", {}).items():
                    families["chunks"].add_metric([model, name], totals.chunks)
                    families["bytes"].add_metric([model, name], totals.bytes)
                    families["put_s"].add_metric([model, name], totals.put_ns / 1e9)
                    families["queued"].add_metric([model, name], totals.queued)
                for name, held in getattr(inspection, "held", {}).items():
                    families["held"].add_metric([model, name], held)
                    if slots.get(name):
                        families["occupancy"].add_metric([model, name], held / slots[name])
        yield from families.values()


@dataclass
class RequestStats:
    """One request's per-stage and per-edge figures, as `--log-stats` prints them."""

    stages: dict[str, dict] = field(default_factory=dict)
    edges: dict[str, dict] = field(default_factory=dict)


class PipelineStats:
    """The runtime's stats hook for one served pipeline. The engine calls these methods (from
    any thread) as it runs; each feeds the Prometheus series above and, where a request id
    is given, that request's tables for `--log-stats`:

    - `stage_step(stage, batch_size, seconds, request_ids=(), tokens_in=0, tokens_out=0)`:
      one step of a stage over a batch;
    - `edge_transfer(edge, nbytes, seconds, request_id=None, decode_seconds=0.0,
      in_flight_seconds=0.0)`: one chunk handed over an edge (`seconds`: from its write
      to its read);
    - `request_done(request_id, stages, edges)`: a request's whole tables at once, for an
      engine that keeps them itself (keys as `--log-stats` prints them).

    Calling the object with an event whose class is named `StageStep`, `EdgeTransfer` or
    `RequestStats` and whose fields are those arguments does the same,
    so the engine can hand over its own message structs unchanged.
    """

    KEEP = 4096  # requests whose tables wait for their HTTP request to take them

    def __init__(self, metrics: Metrics, model: str):
        self.metrics = metrics
        self.model = model
        self._lock = threading.Lock()
        self._requests: OrderedDict[str, RequestStats] = OrderedDict()

    def __call__(self, event) -> None:
        handler = {
            "StageStep": self.stage_step,
            "EdgeTransfer": self.edge_transfer,
            "RequestStats": self.request_done,
        }.get(type(event).__name__)
        if handler is None:
            return
        fields = getattr(event, "__struct_fields__", None) or vars(event)
        handler(**{name: getattr(event, name) for name in fields})

    def stage_step(
        self,
        stage: str,
        batch_size: int,
        seconds: float,
        request_ids=(),
        tokens_in: int = 0,
        tokens_out: int = 0,
    ) -> None:
        self.metrics.stage_batch.labels(self.model, stage).observe(batch_size)
        self.metrics.stage_step.labels(self.model, stage).observe(seconds)
        for request_id in request_ids:
            row = self._row(request_id, "stages", stage)
            row["batch_size"] = max(row.get("batch_size", 0), batch_size)
            row["num_tokens_in"] = row.get("num_tokens_in", 0) + tokens_in
            row["num_tokens_out"] = row.get("num_tokens_out", 0) + tokens_out
            row["stage_gen_time_ms"] = row.get("stage_gen_time_ms", 0.0) + seconds * 1e3

    def edge_transfer(
        self,
        edge: str,
        nbytes: int,
        seconds: float,
        request_id: str | None = None,
        decode_seconds: float = 0.0,
        in_flight_seconds: float = 0.0,
    ) -> None:
        self.metrics.edge_handoff.labels(self.model, edge).observe(seconds)
        if request_id is not None:
            row = self._row(request_id, "edges", edge)
            row["size_kbytes"] = row.get("size_kbytes", 0.0) + nbytes / 1024
            row["tx_time_ms"] = row.get("tx_time_ms", 0.0) + seconds * 1e3
            row["rx_decode_time_ms"] = row.get("rx_decode_time_ms", 0.0) + decode_seconds * 1e3
            row["in_flight_time_ms"] = row.get("in_flight_time_ms", 0.0) + in_flight_seconds * 1e3

    def request_done(self, request_id: str, stages: dict, edges: dict) -> None:
        with self._lock:
            stats = self._stats(request_id)
            stats.stages.update({k: dict(v) for k, v in stages.items()})
            stats.edges.update({k: dict(v) for k, v in edges.items()})

    def take(self, request_id: str) -> RequestStats:
        """A finished request's tables (empty where the runtime reported nothing)."""
        with self._lock:
            return self._requests.pop(request_id, None) or RequestStats()

    def _stats(self, request_id: str) -> RequestStats:
        stats = self._requests.get(request_id)
        if stats is None:
            stats = self._requests[request_id] = RequestStats()
            while len(self._requests) > self.KEEP:
                self._requests.popitem(last=False)
        return stats

    def _row(self, request_id: str, table: str, name: str) -> dict:
        with self._lock:
            return getattr(self._stats(request_id), table).setdefault(name, {})
