"""The live dashboard a server mounts: the compiled graph with each stage's utilisation,
queue depth and batch size and each edge's ring occupancy and throughput, refreshed every
second from a JSON snapshot; buttons that start and stop a profile, and links to the trace
and report of the last one.

Everything comes from `engine.inspect()` (always-on counters: a few integer adds per step
and per chunk) and the plan; rates are the counters' deltas between two snapshots.

- `dashboard_html(plan, urls)`: the page (self-contained; it fetches only from its server).
- `dashboard_snapshot(plan, inspections, previous, now)`: one snapshot, rates against the
  previous one.
- `Dashboard(engine)`: both, keeping the previous snapshot, plus `start_profile`,
  `stop_profile`, `trace` and `report` for the routes that start and stop a profile and serve
  its files. Its methods block (inspecting asks every executor): call them from a worker
  thread, as FastAPI does for plain `def` endpoints.
"""

from __future__ import annotations

import threading
import time

import msgspec

from omniflow.plan import FRONTEND, Plan
from omniflow.profiler.graphs import plan_graph
from omniflow.profiler.html import page
from omniflow.profiler.report import render_report
from omniflow.profiler.trace import chrome_trace
from omniflow.runtime.control import Inspection

# The routes the page talks to, relative to the server's root (a server mounted elsewhere
# passes its own).
URLS = {
    "page": "/dashboard",
    "snapshot": "/dashboard.json",
    "start": "/start_profile",
    "stop": "/stop_profile",
    "trace": "/profile/trace.json",
    "report": "/profile/report.html",
}
REFRESH_S = 1.0


def dashboard_html(plan: Plan, urls: dict[str, str] | None = None) -> str:
    """The dashboard page for `plan`; it polls `urls["snapshot"]` every second."""
    data = {
        "title": f"omniflow dashboard: {plan.pipeline}",
        "pipeline": plan.pipeline,
        "graph": plan_graph(msgspec.to_builtins(plan)),
        "stages": [s.name for s in plan.stages],
        "edges": [{"name": c.name, "kind": c.kind, "slots": c.slots} for c in plan.channels],
        "urls": {**URLS, **(urls or {})},
        "refresh_ms": int(REFRESH_S * 1000),
    }
    subtitle = "live: refreshed every second from the engine's counters"
    return page(data["title"], BODY, "dashboard.js", data, connect="'self'", subtitle=subtitle)


def _totals(inspections: dict[str, Inspection]) -> dict:
    stages, channels = {}, {}
    for inspection in inspections.values():
        for name, t in inspection.stages.items():
            stages[name] = [t.steps, t.step_ns, t.calls]
        for name, t in inspection.channels.items():
            channels[name] = [t.chunks, t.bytes, t.put_ns]
    return {"stages": stages, "channels": channels}


def dashboard_snapshot(
    plan: Plan,
    inspections: dict[str, Inspection],
    previous: dict | None = None,
    now: float | None = None,
) -> dict:
    """What the dashboard shows now: per stage its utilisation, requests held and mean batch
    size; per edge its ring's slots in use (those the consumer's stages hold, or all of them
    while chunks wait in the producer's outbox for credits) and its throughput.
    Rates are over the time since `previous` (a snapshot this returned); the first snapshot
    has none."""
    now = time.monotonic() if now is None else now
    totals = _totals(inspections)
    dt = None if previous is None else now - previous["t"]
    before = previous["totals"] if previous is not None else None

    def delta(kind: str, name: str, i: int) -> int | None:
        if before is None or name not in totals[kind] or name not in before[kind]:
            return None
        return totals[kind][name][i] - before[kind][name][i]

    calls = {s: c for i in inspections.values() for s, c in i.calls.items()}
    stages = {}
    for s in plan.stages:
        steps, busy, advanced = (delta("stages", s.name, i) for i in range(3))
        stages[s.name] = {
            "executor": s.executor,
            "queue": len(calls.get(s.name, ())),
            "utilisation": None if busy is None or not dt else min(1.0, busy / (dt * 1e9)),
            "batch": advanced / steps if steps else None,
            "steps_per_s": None if steps is None or not dt else steps / dt,
        }
    held = {c: n for i in inspections.values() for c, n in i.held.items()}
    queued = {c: t.queued for i in inspections.values() for c, t in i.channels.items()}
    edges = {}
    for c in plan.channels:
        chunks, nbytes, put_ns = (delta("channels", c.name, i) for i in range(3))
        # Chunks wait in the producer's outbox only when the ring had no free slot.
        full = bool(queued.get(c.name))
        used = c.slots if full else held.get(c.name)
        edges[c.name] = {
            "kind": c.kind,
            "slots": c.slots,
            "held": held.get(c.name),
            "used": used,
            "full": full,
            "occupancy": used / c.slots if used is not None and c.slots else None,
            "queued": queued.get(c.name),
            "chunks_per_s": None if chunks is None or not dt else chunks / dt,
            "bytes_per_s": None if nbytes is None or not dt else nbytes / dt,
            "put_us": put_ns / chunks / 1e3 if chunks else None,
        }
    frontend = inspections.get(FRONTEND)
    return {
        "t": now,
        "interval_s": dt,
        "requests": len(frontend.calls.get(FRONTEND, ())) if frontend is not None else None,
        "stages": stages,
        "edges": edges,
        "executors": {
            name: {"held_slots": i.held_slots, "queued_chunks": i.queued_chunks}
            for name, i in inspections.items()
        },
        "totals": totals,
    }


class Dashboard:
    """The dashboard of one engine: the page, its snapshots, and profiles started and stopped
    from it (the last one's trace and report are kept for download)."""

    def __init__(self, engine, urls: dict[str, str] | None = None, capacity: int = 1 << 16):
        self.engine = engine
        self.plan: Plan = engine.plan
        self.urls = {**URLS, **(urls or {})}
        self.capacity = capacity
        self._lock = threading.Lock()
        self._previous: dict | None = None
        self._profiling_since: float | None = None
        self._trace: dict | None = None
        self._report: str | None = None

    def page(self) -> str:
        """GET /dashboard (text/html)."""
        return dashboard_html(self.plan, self.urls)

    def snapshot(self) -> dict:
        """GET /dashboard.json."""
        inspections = self.engine.inspect()
        with self._lock:
            snap = dashboard_snapshot(self.plan, inspections, self._previous)
            self._previous = snap
            snap = dict(snap)
            snap["profile"] = self._profile_state()
        return snap

    def _profile_state(self) -> dict:
        return {
            "on": self._profiling_since is not None,
            "seconds": None
            if self._profiling_since is None
            else time.monotonic() - self._profiling_since,
            "trace": self._trace is not None,
        }

    def start_profile(
        self, gpu: bool = False, stages: list[str] | None = None, requests: list[str] | None = None
    ) -> dict:
        """POST /start_profile: every executor starts recording (a profile already running
        starts over); with `gpu`, the GPU stages' kernel timeline too; only `stages` and the
        requests whose ids start with one of `requests`, where given."""
        self.engine.start_profile(self.capacity, gpu, stages, requests)
        with self._lock:
            self._profiling_since = time.monotonic()
            return self._profile_state()

    def stop_profile(self) -> dict:
        """POST /stop_profile: stop recording; the trace (and, when first asked for, its
        report) are kept for `trace()` and `report()`."""
        profiles = self.engine.stop_profile()
        trace = chrome_trace(profiles, self.plan)
        with self._lock:
            self._profiling_since = None
            self._trace, self._report = trace, None
            state = self._profile_state()
        events = sum(1 for e in trace["traceEvents"] if e["ph"] != "M")
        return {
            **state,
            "events": events,
            "trace_url": self.urls["trace"],
            "report_url": self.urls["report"],
        }

    def trace(self) -> dict | None:
        """GET /profile/trace.json: the last stopped profile's Chrome trace (None: 404)."""
        with self._lock:
            return self._trace

    def report(self) -> str | None:
        """GET /profile/report.html: the last stopped profile's report (None: 404)."""
        with self._lock:
            trace, report = self._trace, self._report
        if trace is None:
            return None
        if report is None:
            report = render_report(trace)
            with self._lock:
                if self._trace is trace:
                    self._report = report
        return report


BODY = """
<main>
  <div class="controls">
    <button id="start">Start profile</button>
    <button id="stop" disabled>Stop profile</button>
    <a id="report" href="#" hidden>Download report</a>
    <a id="trace" href="#" hidden download="trace.json">Download trace</a>
    <span class="status" id="status"></span>
  </div>
  <section>
    <div class="graph" id="graph"></div>
  </section>
  <section>
    <div class="row">
      <div class="col card"><h3>Utilisation per stage</h3><div class="chart"><canvas id="util"></canvas></div></div>
      <div class="col card"><h3>Requests held per stage (queue depth)</h3><div class="chart"><canvas id="queue"></canvas></div></div>
    </div>
  </section>
  <section>
    <h2>Stages</h2><div id="stage-table"></div>
    <h2>Edges</h2><div id="edge-table"></div>
  </section>
</main>
"""
