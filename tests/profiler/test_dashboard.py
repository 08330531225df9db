"""The dashboard's snapshots: rates from the counters' deltas between two snapshots, queue
depths and ring slots held from the inspection, and profiles started and stopped from it."""

import pytest

from omniflow.compiler import compile_source
from omniflow.plan import FRONTEND
from omniflow.profiler import Dashboard, dashboard_html, dashboard_snapshot
from omniflow.runtime.control import ChannelTotals, Inspection, StageTotals
from omniflow.runtime.engine import Engine
from tests.profiler.helpers import SPLIT


def inspections(steps, step_ns, calls, chunks, nbytes, held, queued=1):
    return {
        "a+b": Inspection(
            "a+b",
            {"a": ["r1"], "b": ["r1", "r2"]},
            0,
            1,
            {"a": StageTotals(steps, step_ns, calls), "b": StageTotals(steps, step_ns // 2, calls)},
            {"b.out->c.in": ChannelTotals(chunks, nbytes, 1000 * chunks, queued)},
        ),
        "c": Inspection("c", {"c": []}, held, 0, {"c": StageTotals()}, {}, {"b.out->c.in": held}),
        FRONTEND: Inspection(FRONTEND, {FRONTEND: ["r1", "r2"]}, 0, 0),
    }


def test_rates_come_from_the_counters_between_two_snapshots():
    plan = compile_source(SPLIT, "split.omni")
    first = dashboard_snapshot(plan, inspections(10, 10**9, 20, 5, 500, 0), None, now=100.0)
    assert first["interval_s"] is None and first["stages"]["a"]["utilisation"] is None
    assert first["stages"]["b"]["queue"] == 2 and first["requests"] == 2
    later = inspections(30, 2 * 10**9, 80, 25, 2500, 3)
    snap = dashboard_snapshot(plan, later, first, now=102.0)
    a, b = snap["stages"]["a"], snap["stages"]["b"]
    assert snap["interval_s"] == 2.0
    assert a["utilisation"] == pytest.approx(0.5) and b["utilisation"] == pytest.approx(0.25)
    assert a["batch"] == pytest.approx(3.0) and a["steps_per_s"] == pytest.approx(10.0)
    edge = snap["edges"]["b.out->c.in"]
    assert edge["chunks_per_s"] == pytest.approx(10.0)
    assert edge["bytes_per_s"] == pytest.approx(1000)
    assert edge["held"] == 3 and edge["put_us"] == pytest.approx(1.0)
    # A chunk waits for credits: the ring is full, whatever the consumer holds.
    assert edge["queued"] == 1 and edge["full"] and edge["occupancy"] == 1.0
    # Else the ring holds what the consumer's stages hold.
    calm = dashboard_snapshot(plan, inspections(30, 2 * 10**9, 80, 25, 2500, 3, 0), snap, 103.0)
    slots = next(c.slots for c in plan.channels if c.name == "b.out->c.in")
    assert not calm["edges"]["b.out->c.in"]["full"]
    assert calm["edges"]["b.out->c.in"]["occupancy"] == pytest.approx(3 / slots)
    assert calm["stages"]["a"]["utilisation"] == 0.0 and calm["stages"]["a"]["batch"] is None
    assert snap["edges"]["x.out->a.in"]["occupancy"] in (None, 0.0)
    assert snap["stages"]["c"]["batch"] is None  # no steps in the interval


def test_a_dashboard_over_a_running_engine(tmp_path):
    plan = compile_source(SPLIT, "split.omni")
    html = dashboard_html(plan, {"snapshot": "/x/dashboard.json"})
    assert "connect-src 'self'" in html and "/x/dashboard.json" in html
    with Engine(plan, "process") as engine:
        dashboard = Dashboard(engine)
        assert dashboard.report() is None and dashboard.trace() is None
        dashboard.snapshot()
        assert dashboard.start_profile()["on"]
        for i in range(3):
            engine.generate({"x": [[i]] * 9}, request_id=f"s{i}")
        snap = dashboard.snapshot()
        assert snap["stages"]["c"]["steps_per_s"] > 0 and snap["profile"]["on"]
        assert snap["edges"]["b.out->c.in"]["chunks_per_s"] > 0
        stopped = dashboard.stop_profile()
        assert not stopped["on"] and stopped["trace"] and stopped["events"] > 0
        assert dashboard.trace()["otherData"]["plan"]["pipeline"] == "split"
        assert "omniflow profile: split" in dashboard.report()
