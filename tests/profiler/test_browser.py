"""The report, the compiler's passes (--viz) and the live dashboard, opened in headless
Chromium: no console errors, nothing loaded from anywhere, a box per stage of the plan, a
waterfall lane per stage, and a request picker that changes the waterfall."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from omniflow.cli import main
from omniflow.compiler import compile_file, compile_source
from omniflow.profiler import Dashboard
from omniflow.profiler.report import write_report
from omniflow.runtime.engine import Engine
from tests.profiler.helpers import SPLIT
from tests.profiler.test_analysis import two_requests

GRAPHS = Path(__file__).parents[2] / "graphs"

WATERFALL = """() => {
  const chart = window.omniflowReport.waterfall;
  return {
    title: document.getElementById("waterfall-title").textContent,
    lanes: chart.scales.y.getLabels(),
    bars: Object.fromEntries(chart.data.datasets.filter((d) => d.type === "bar")
      .map((d) => [d.label, d.data.map((p) => p.x)])),
  };
}"""


def only_the_page_loaded(page, url: str) -> None:
    assert page.requests == [url], page.requests
    assert page.errors == [], page.errors


def stage_boxes(page) -> list[str]:
    return page.eval_on_selector_all("#graph .node.stage", "ns => ns.map(n => n.dataset.stage)")


def test_the_report_draws_the_plan_and_a_waterfall_per_request(split_profile, tmp_path, open_page):
    plan, trace = split_profile
    path = write_report(trace, tmp_path / "report.html")
    url = path.as_uri()
    page = open_page(url)
    page.wait_for_function("() => window.omniflowReport && window.omniflowReport.waterfall")
    stages = [s.name for s in plan.stages]
    assert sorted(stage_boxes(page)) == sorted(stages)
    # Executors and devices are boxes around them: the fused pair shares one.
    clusters = page.eval_on_selector_all("#graph .cluster", "cs => cs.map(c => c.dataset.cluster)")
    assert set(clusters) == {"device:cpu", "executor:a+b", "executor:c"}
    first = page.evaluate(WATERFALL)
    assert [lane for lane in first["lanes"] if lane in stages] == stages  # a lane per stage
    assert all(first["bars"][s] for s in stages)  # the request stepped in every lane
    ids = page.eval_on_selector_all("#picker option", "os => os.map(o => o.value)")
    assert sorted(ids) == sorted(f"r{i}" for i in range(24))
    assert first["title"].startswith(f"Request {ids[0]}:")
    # Picking another request redraws the waterfall with that request's steps.
    page.select_option("#picker", ids[-1])
    picked = page.evaluate(WATERFALL)
    assert picked["title"].startswith(f"Request {ids[-1]}:") and picked["bars"] != first["bars"]
    # The filter narrows the picker (and the summary to what it keeps).
    page.fill("#filter", "r1")
    options = page.eval_on_selector_all("#picker option", "os => os.map(o => o.value)")
    assert options and all("r1" in o for o in options)
    assert f"{len(options)} requests matching" in page.text_content("#summary-scope")
    assert "is bound by" in page.text_content("#summary-text")
    only_the_page_loaded(page, url)


def test_the_report_of_a_partly_recorded_profile(tmp_path, open_page):
    # Executor a+b began recording after r0 had gone through it (tests/profiler/test_analysis):
    # r0's path has time no event explains, which the page says, and the edge table counts
    # the chunks whose put was not recorded.
    trace = two_requests(late_ab=400).trace()
    url = write_report(trace, tmp_path / "report.html").as_uri()
    page = open_page(url)
    page.wait_for_function("() => window.omniflowReport && window.omniflowReport.waterfall")
    subtitle = page.text_content("#subtitle")
    assert "1 request began before every executor on its path was recording" in subtitle
    page.evaluate("window.omniflowReport.pick('r0')")
    assert "bound by time the profile did not record" in page.text_content("#summary-text")
    assert "b (unrecorded)" in page.text_content("#summary-legend")
    headers = page.eval_on_selector_all("#edges th", "hs => hs.map(h => h.textContent)")
    assert {"chunks put", "taken", "never taken", "put unrecorded"} <= set(headers)
    only_the_page_loaded(page, url)


def test_the_report_stays_usable_at_a_thousand_requests(thousand_profile, tmp_path, open_page):
    _plan, trace = thousand_profile
    url = write_report(trace, tmp_path / "report.html").as_uri()
    page = open_page(url)
    page.wait_for_function("() => window.omniflowReport && window.omniflowReport.waterfall")
    assert page.eval_on_selector("#picker", "p => p.options.length") == 1000
    page.select_option("#sort", "e2e")
    slowest = page.eval_on_selector("#picker", "p => p.value")
    assert page.evaluate(WATERFALL)["title"].startswith(f"Request {slowest}:")
    page.select_option("#picker", "r999")
    assert page.evaluate(WATERFALL)["title"].startswith("Request r999:")
    only_the_page_loaded(page, url)


def test_the_passes_step_through_with_their_changes_outlined(tmp_path, open_page):
    out = tmp_path / "viz.html"
    assert (
        main(["compile", str(GRAPHS / "omni_chat.omni"), "--devices", "2xH200", "--viz", str(out)])
        == 0
    )
    # Every pass draws every stage of the graph: the encoders, the thinker, talker, code2wav.
    stages = sorted(s.name for s in compile_file(GRAPHS / "omni_chat.omni", "2xH200").stages)
    assert {"hearing", "vision", "thinker", "talker", "code2wav"} <= set(stages)
    page = open_page(out.as_uri())
    page.wait_for_function("() => window.omniflowViz")
    passes = page.evaluate("window.omniflowViz.passes")
    assert passes[0] == "source" and passes[-1] == "plan_buffers" and len(passes) == 9
    for i, name in enumerate(passes):
        page.click(f'button[data-pass="{name}"]')
        assert sorted(stage_boxes(page)) == stages, name
        changed = page.eval_on_selector_all("#graph .changed", "cs => cs.length")
        tags = set(page.eval_on_selector_all("#changes .tag", "ts => ts.map(t => t.textContent)"))
        assert (changed > 0) == (i > 0), name
        expected = {"infer_types": "types", "place": "devices", "fuse_stages": "fusion"}
        expected |= {"size_chunks": "chunks", "plan_buffers": "buffers"}
        if name in expected:
            assert expected[name] in tags, (name, tags)
    # After fusion the stages sit in executor boxes; the arrow keys step back and forth.
    clusters = page.eval_on_selector_all("#graph .cluster", "cs => cs.map(c => c.dataset.cluster)")
    assert "executor:thinker+talker" in clusters
    page.keyboard.press("ArrowLeft")
    assert page.evaluate("window.omniflowViz.current") == len(passes) - 2
    page.keyboard.press("ArrowRight")
    assert page.evaluate("window.omniflowViz.current") == len(passes) - 1
    only_the_page_loaded(page, out.as_uri())


class _Routes(BaseHTTPRequestHandler):
    """The routes a server mounts for the dashboard, as the HTTP server's colleague will."""

    dashboard: Dashboard

    def _send(self, status: int, body: str | bytes, kind: str) -> None:
        data = body.encode() if isinstance(body, str) else body
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):  # noqa: N802
        d = self.dashboard
        if self.path == "/dashboard":
            self._send(200, d.page(), "text/html")
        elif self.path == "/dashboard.json":
            self._send(200, json.dumps(d.snapshot()), "application/json")
        elif self.path == "/profile/report.html" and d.report() is not None:
            self._send(200, d.report(), "text/html")
        elif self.path == "/profile/trace.json" and d.trace() is not None:
            self._send(200, json.dumps(d.trace()), "application/json")
        else:
            self._send(404, "not found", "text/plain")

    def do_POST(self):  # noqa: N802
        actions = {
            "/start_profile": self.dashboard.start_profile,
            "/stop_profile": self.dashboard.stop_profile,
        }
        if self.path in actions:
            self._send(200, json.dumps(actions[self.path]()), "application/json")
        else:
            self._send(404, "not found", "text/plain")

    def log_message(self, *args):
        pass


@pytest.fixture
def served():
    plan = compile_source(SPLIT, "split.omni")
    with Engine(plan, "inprocess") as engine:
        routes = type("Routes", (_Routes,), {"dashboard": Dashboard(engine)})
        server = ThreadingHTTPServer(("127.0.0.1", 0), routes)
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        try:
            yield plan, engine, f"http://127.0.0.1:{server.server_port}"
        finally:
            server.shutdown()
            server.server_close()


def test_the_dashboard_shows_live_counters_and_profiles_on_demand(served, open_page):
    plan, engine, base = served
    page = open_page(f"{base}/dashboard")
    page.wait_for_function("() => window.omniflowDashboard && window.omniflowDashboard.last")
    assert sorted(stage_boxes(page)) == sorted(s.name for s in plan.stages)
    page.click("#start")
    page.wait_for_selector("#stop:not([disabled])")
    for i in range(6):
        engine.generate({"x": [[i], [i + 1], [i + 2]]}, request_id=f"d{i}")
    # A snapshot after the requests sees their steps: rates and batch sizes.
    page.wait_for_function(
        "() => Object.values(window.omniflowDashboard.last.stages).some(x => x.steps_per_s > 0)"
    )
    page.click("#stop")
    page.wait_for_selector("#report:not([hidden])")
    assert "a" in page.text_content("#stage-table")
    only = [u for u in page.requests if not u.startswith(base)]
    assert only == [] and page.errors == []
    report = open_page(f"{base}/profile/report.html")
    report.wait_for_function("() => window.omniflowReport && window.omniflowReport.waterfall")
    ids = report.eval_on_selector_all("#picker option", "os => os.map(o => o.value)")
    assert sorted(ids) == [f"d{i}" for i in range(6)]
    assert report.errors == []
