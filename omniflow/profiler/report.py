"""`omniflow profile TRACE.json -o report.html`: one self-contained HTML page made from a
trace file alone (trace.py; its `otherData["plan"]` is the compiled plan).

It shows the compiled graph (stages in executors in devices, edges with their chunk schedules
and rings), a waterfall per request (a lane per stage, its steps there, its chunks handed
between lanes, TTFP and E2E marked) with a request picker, per-stage and per-edge tables,
latency distributions, and where the time went: the critical path of the selected requests
and the stage or edge that bounds their TTFP and E2E.

The page stays small at a thousand requests: a request's waterfall keeps at most a few dozen
segments per lane (neighbouring steps merge, the tooltip says how many) and a dozen chunks per
edge, on a grid of 1/4000 of its duration; the budget tightens until the data fits.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

from omniflow.profiler import analysis
from omniflow.profiler.analysis import Call, Profile, RequestTimeline
from omniflow.profiler.graphs import device_budgets, plan_graph
from omniflow.profiler.html import page

GRID = 4000  # a request's waterfall is drawn on this many steps of its duration
REQUEST_BUDGET = 1_450_000  # characters of JSON for every request's waterfall together
# (segments per lane, chunks per edge): tried in turn until the requests fit the budget.
DETAIL = ((48, 16), (24, 10), (12, 6), (6, 4), (3, 2), (1, 1))


def load_trace(path: str | Path) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _ms(us: float | None) -> float | None:
    return None if us is None else round(us / 1e3, 3)


def _segments(calls: list[Call], t0: float, q: float, keep: int) -> list[int]:
    """Calls as [start, length, calls merged, ...] on the request's grid, at most `keep`
    segments: only the widest gaps (and none under two grid steps, which cannot be seen)
    stay open."""
    spans = sorted((c.start, c.end) for c in calls)
    if not spans:
        return []
    gaps = [(b[0] - a[1], i) for i, (a, b) in enumerate(zip(spans, spans[1:], strict=False))]
    widest = sorted(gaps, reverse=True)[: keep - 1]
    breaks = {i for gap, i in widest if gap > 2 * q}
    out: list[int] = []
    first, last, n = spans[0][0], spans[0][1], 0
    for i, (start, end) in enumerate(spans):
        if n == 0:
            first, last = start, end
        n += 1
        last = max(last, end)
        if i in breaks or i == len(spans) - 1:
            s = round((first - t0) / q)
            out += [s, max(1, round((last - t0) / q) - s), n]
            n = 0
    return out


def _sample(items: list, keep: int) -> list:
    if len(items) <= keep:
        return items
    if keep == 1:
        return items[:1]
    return [items[round(i * (len(items) - 1) / (keep - 1))] for i in range(keep)]


def _request(
    r: RequestTimeline,
    profile: Profile,
    lanes: list[str],
    channels: list[str],
    components: dict[str, int],
    detail: tuple[int, int],
    origin: float,
) -> dict:
    keep_segments, keep_chunks = detail
    times = [c.end for cs in r.calls.values() for c in cs]
    times += [t.take for ts in r.trips.values() for t in ts if t.take is not None]
    end = max([r.t0 + 1, *times])
    q = float(f"{max((end - r.t0) / GRID, 0.001):.3g}")
    hand = []
    for i, name in enumerate(channels):
        trips = [t for t in r.trips.get(name, ()) if t.put is not None and t.take is not None]
        if trips:
            row = [i]
            for t in _sample(trips, keep_chunks):
                row += [round((t.put - r.t0) / q), round((t.take - r.t0) / q)]
            hand.append(row)

    def path(spent: dict[str, float]) -> list:
        flat: list = []
        for name, us in sorted(spent.items(), key=lambda kv: -kv[1]):
            flat += [components.setdefault(name, len(components)), round(us / 1e3, 3)]
        return flat

    return {
        "id": r.id,
        "t0": _ms(r.t0 - origin),
        "e2e": _ms(r.e2e),
        "ttfp": [_ms(r.ttfp.get(o)) for o in profile.outputs],
        "ok": r.complete,
        "q": q,
        "lanes": [_segments(r.calls.get(stage, []), r.t0, q, keep_segments) for stage in lanes],
        "hand": hand,
        "cpE": path(r.path_e2e),
        "cpT": [path(r.path_ttfp[o]) if o in r.path_ttfp else None for o in profile.outputs],
        "route": [lanes.index(s) for s in r.route if s in lanes],
        "last": _last_output(r, profile),
        "counted": r.counters,
    }


def _last_output(r: RequestTimeline, profile: Profile) -> int | None:
    """The output whose last chunk ended the request (where its E2E critical path ends)."""
    last, which = -math.inf, None
    for name, trips in r.trips.items():
        info = profile.channels.get(name)
        if info is not None and info.dst in profile.outputs:
            for t in trips:
                if t.take is not None and t.take > last:
                    last, which = t.take, profile.outputs.index(info.dst)
    return which


def _headline_output(profile: Profile, requests: list[RequestTimeline]) -> str | None:
    """The output whose first packet comes last (median): what TTFP means on the page."""
    best, best_value = None, -math.inf
    for output in profile.outputs:
        value = analysis.quantile([r.ttfp[output] for r in requests if output in r.ttfp], 0.5)
        if value is not None and value > best_value:
            best, best_value = output, value
    return best


def report_data(trace: dict) -> dict:
    """What the report page draws, from a trace (dict)."""
    profile = analysis.parse_trace(trace)
    requests = analysis.timelines(profile)
    lanes = list(profile.stages)
    channels = [n for n, c in profile.channels.items() if c.kind != "local"]
    origin = profile.window[0]
    encoded: list[dict] = []
    components: dict[str, int] = {}
    for detail in DETAIL:
        components = {}
        encoded = [
            _request(r, profile, lanes, channels, components, detail, origin) for r in requests
        ]
        if len(json.dumps(encoded, separators=(",", ":"))) <= REQUEST_BUDGET:
            break
    owners = []
    for name in components:
        # kind: "steps" (a stage's own), "edge" (handing chunks over), "waiting" (a stage, or
        # an input's edge, waiting), "unrecorded" (before its executor's events begin)
        owner, kind = analysis.component_owner(name)
        edge = owner in profile.channels
        kind = "edge" if edge and kind == "steps" else kind
        owners.append({"owner": owner, "kind": kind, "edge": edge})
    plan = profile.plan
    graph = plan_graph(plan) if plan is not None else _bare_graph(profile)
    complete = [r for r in requests if r.complete]
    return {
        "title": f"omniflow profile: {profile.pipeline or 'pipeline'}",
        "pipeline": profile.pipeline,
        "made": time.strftime("%Y-%m-%d %H:%M:%S"),
        "window_us": profile.window[1] - profile.window[0],
        "dropped": profile.dropped,
        "has_plan": plan is not None,
        "executors": profile.executors,
        "graph": graph,
        "devices": device_budgets(plan) if plan is not None else [],
        "lanes": lanes,
        "channels": [
            {"name": n, "src": profile.channels[n].src, "dst": profile.channels[n].dst}
            for n in channels
        ],
        "inputs": profile.inputs,
        "outputs": profile.outputs,
        "headline": _headline_output(profile, complete),
        "stages": analysis.stage_stats(profile),
        "edges": analysis.edge_stats(profile),
        "components": list(components),
        "owners": owners,
        "requests": encoded,
    }


def _bare_graph(profile: Profile) -> dict:
    """Without a plan in the trace: the stages and channels the events name."""
    nodes = [
        {"id": s, "label": s, "sub": [profile.stage_executor.get(s, "")], "cls": "stage"}
        for s in profile.stages
    ]
    nodes += [{"id": p, "label": p, "sub": ["input"], "cls": "port"} for p in profile.inputs]
    nodes += [{"id": p, "label": p, "sub": ["output"], "cls": "port"} for p in profile.outputs]
    edges = [
        {"id": c.name, "from": c.src, "to": c.dst, "label": [], "cls": "shm"}
        for c in profile.channels.values()
    ]
    # A stage no recorded channel feeds is fed by reference inside its executor (inferred).
    edges += [
        {"id": f"{src}->{dst}", "from": src, "to": dst, "label": ["by reference"], "cls": "local"}
        for dst, srcs in profile.feeds.items()
        for src in srcs
    ]
    return {"clusters": [], "nodes": nodes, "edges": edges}


BODY = """
<main>
  <section id="summary" class="summary">
    <h2>Where the time went <span class="muted" id="summary-scope"></span></h2>
    <div id="summary-text"></div>
    <div class="bar" id="summary-bar"></div>
    <div class="legend" id="summary-legend"></div>
  </section>
  <section>
    <h2>The compiled graph</h2>
    <div class="muted">Stages in their executors (a fused group shares one process) on their
    devices, with memory budgets; edges with their chunk schedules and buffers. Shading: each
    stage's utilisation during the profile.</div>
    <div class="graph" id="graph"></div>
    <div id="device-table"></div>
  </section>
  <section>
    <h2>Requests</h2>
    <div class="row">
      <div class="picker">
        <input type="search" id="filter" placeholder="filter by request id">
        <select id="sort">
          <option value="t0">by arrival</option>
          <option value="e2e">slowest E2E first</option>
          <option value="ttfp">slowest TTFP first</option>
        </select>
        <select id="picker" size="16"></select>
        <div class="pick-info" id="pick-count"></div>
      </div>
      <div class="col">
        <h3 id="waterfall-title"></h3>
        <div class="chart tall"><canvas id="waterfall"></canvas></div>
        <div class="muted" id="waterfall-note"></div>
      </div>
    </div>
  </section>
  <section>
    <h2>Latency</h2>
    <div class="row">
      <div class="col card"><h3>Distribution (CDF)</h3><div class="chart"><canvas id="cdf"></canvas></div></div>
      <div class="col card"><h3>Per request (click one to pick it)</h3><div class="chart"><canvas id="scatter"></canvas></div></div>
    </div>
    <div id="latency-table"></div>
  </section>
  <section>
    <h2>Stages</h2>
    <div id="stage-table"></div>
    <div class="row">
      <div class="col card"><h3>Batch size distribution (steps)</h3><div class="chart"><canvas id="batches"></canvas></div></div>
      <div class="col card"><h3>Step time (p50, p99)</h3><div class="chart"><canvas id="steptimes"></canvas></div></div>
    </div>
  </section>
  <section>
    <h2>Edges</h2>
    <div id="edge-table"></div>
  </section>
</main>
"""


def render_report(trace: dict) -> str:
    data = report_data(trace)
    return page(data["title"], BODY, "report.js", data)


def write_report(trace: dict | str | Path, out: str | Path) -> Path:
    """The report of a trace (dict, or a trace file's path) written to `out`."""
    if not isinstance(trace, dict):
        trace = load_trace(trace)
    out = Path(out)
    out.write_text(render_report(trace), encoding="utf-8")
    return out


__all__ = ["load_trace", "render_report", "report_data", "write_report"]
