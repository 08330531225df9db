"""The report made from a trace file alone: every request's critical path accounts for its
whole latency, the statistics agree with the events, the page is one self-contained file
under 2 MB at a thousand requests, and `omniflow profile` / `profile_to` write it."""

import json
import re

import pytest

from omniflow.cli import main
from omniflow.compiler import compile_source
from omniflow.profiler import profile_to
from omniflow.profiler.analysis import parse_trace, timelines
from omniflow.profiler.html import DATA_ID
from omniflow.profiler.report import render_report, report_data
from omniflow.runtime.engine import Engine
from tests.profiler.helpers import SPLIT


def page_data(html: str) -> dict:
    found = re.search(f'<script type="application/json" id="{DATA_ID}">(.*?)</script>', html, re.S)
    return json.loads(found.group(1))


def test_every_critical_path_adds_up_to_its_requests_latency(split_profile):
    plan, trace = split_profile
    requests = timelines(parse_trace(trace))
    assert len(requests) == 24 and all(r.complete for r in requests)
    for r in requests:
        assert sum(r.path_e2e.values()) == pytest.approx(r.e2e, rel=1e-6)
        for output, ttfp in r.ttfp.items():
            assert 0 < ttfp <= r.e2e
            assert sum(r.path_ttfp[output].values()) == pytest.approx(ttfp, rel=1e-6)
        # The path starts at the stage the input feeds and ends where an output leaves.
        assert r.route[0] == "a" and r.route[-1] in ("b", "c")
        names = {*(s.name for s in plan.stages), *(c.name for c in plan.channels)}
        assert {k.removesuffix(" (waiting)") for k in r.path_e2e} <= names


def test_the_tables_agree_with_the_events(split_profile):
    plan, trace = split_profile
    data = report_data(trace)
    steps = [e for e in trace["traceEvents"] if e["name"].endswith(" step")]
    assert {s["stage"]: s["steps"] for s in data["stages"]} == {
        s.name: sum(e["name"] == f"{s.name} step" for e in steps) for s in plan.stages
    }
    for s in data["stages"]:
        assert 0 < s["utilisation"] <= 1 and s["batch_max"] <= 4
        assert sum(s["batch_hist"].values()) == s["steps"]
    puts = [e for e in trace["traceEvents"] if e["name"].startswith("put ")]
    for e in data["edges"]:
        assert e["chunks"] == sum(p["name"] == f"put {e['edge']}" for p in puts)
        # Every executor recorded from before the first request to after the last one.
        assert e["put_only"] == e["take_only"] == 0
        if e["kind"] == "local":
            assert e["chunks"] == 0  # references inside an executor record nothing
    assert data["lanes"] == [s.name for s in plan.stages]
    assert data["headline"] in ("y", "z") and data["outputs"] == ["y", "z"]


def test_the_report_is_one_self_contained_file(split_profile):
    _plan, trace = split_profile
    html = render_report(trace)
    assert "Content-Security-Policy" in html and "connect-src 'none'" in html
    assert not re.search(r"<(script|img|iframe)[^>]+src=|<link\b|@import|url\((?!#)", html)
    data = page_data(html)
    assert len(data["requests"]) == 24
    assert {n["id"] for n in data["graph"]["nodes"] if n["cls"] == "stage"} == {"a", "b", "c"}
    fused = [c for c in data["graph"]["clusters"] if "fused" in c["cls"]]
    assert [c["label"] for c in fused] == ["executor a+b (fused)"]


def test_a_thousand_requests_fit_in_two_megabytes(thousand_profile):
    # Long requests: many steps per lane, merged down to what the budget allows.
    _plan, trace = thousand_profile
    html = render_report(trace)
    assert len(html.encode()) < 2_000_000
    data = page_data(html)
    assert len(data["requests"]) == 1000 and all(r["ok"] for r in data["requests"])


def test_a_trace_without_a_plan_still_makes_a_report(split_profile):
    _plan, trace = split_profile
    bare = {**trace, "otherData": {"pipeline": "split"}}
    data = report_data(bare)
    assert not data["has_plan"] and data["lanes"] == ["a", "b", "c"]
    assert len(data["requests"]) == 24


def test_omniflow_profile_writes_the_report(split_profile, tmp_path, capsys):
    _plan, trace = split_profile
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(trace))
    assert main(["profile", str(path), "-o", str(tmp_path / "r.html")]) == 0
    assert len(page_data((tmp_path / "r.html").read_text())["requests"]) == 24
    assert main(["profile", str(path)]) == 0  # next to the trace by default
    assert (tmp_path / "trace.html").is_file()
    (tmp_path / "bad.json").write_text('{"not": "a trace"}')
    assert main(["profile", str(tmp_path / "bad.json")]) == 2
    assert "not a Chrome trace" in capsys.readouterr().err


def test_profile_to_writes_the_trace_and_the_report(tmp_path):

    plan = compile_source(SPLIT, "split.omni")
    with Engine(plan, "inprocess") as engine, profile_to(tmp_path / "prof", engine) as files:
        for i in range(3):
            engine.generate({"x": [[i], [i + 1]]}, request_id=f"q{i}")
    trace = json.loads(files.trace.read_text())
    assert trace["otherData"]["plan"]["pipeline"] == "split" and files.events > 0
    assert [r["id"] for r in page_data(files.report.read_text())["requests"]] == ["q0", "q1", "q2"]
