"""A profile records what happens between stages besides puts and takes: each request's
admission and queueing at the frontend (arrival -> admission checked -> its inputs go out),
and each chunk's pass through an edge's adapter or map chain, where it runs."""

from collections import defaultdict

import pytest
import torch

from omniflow.compiler import compile_source
from omniflow.profiler.report import render_report
from omniflow.profiler.trace import chrome_trace
from omniflow.runtime.engine import Engine
from omniflow.runtime.interpreter import Interpreter

IDENTITY = 'python(fn=omniflow.runtime.builtin_stages.identity, inputs="in:{}", outputs="out:{}")'
# Each kind of place a transform runs: the input's maps in the frontend before its put, an
# adapter (then maps that shrink) in a's executor before the put, the output's maps (which
# grow uint8 to float) in the frontend after the take.
ADAPTED = f"""pipeline adapted {{
  stage a = {IDENTITY.format("audio", "image")}
  stage b = {IDENTITY.format("image", "image")}
  input x: audio -> map(gain(0.5)) -> a
  a.out -> map(denorm | to_uint8) -> b.in [stream, chunk=8, adapter=tests.profiler.stages.negate]
  b.out -> map(gain(0.5)) -> output y [stream]
}}"""
IDS = ["r0", "r1", "r2"]


@pytest.fixture(scope="module")
def trace():
    plan = compile_source(ADAPTED, "adapted.omni")
    runs_in = {c.name: (c.kind, c.pointwise.runs_in) for c in plan.channels}
    assert runs_in == {
        "x.out->a.in": ("shm", "frontend"),
        "a.out->b.in": ("shm", "a"),
        "b.out->y.in": ("shm", "frontend"),
    }
    x = torch.linspace(-1, 1, 16)[:, None]
    want = Interpreter(plan).run({"x": x})["y"]
    with Engine(plan, "process") as engine:
        engine.start_profile()
        for rid in IDS:
            assert torch.equal(engine.generate({"x": x}, request_id=rid)["y"], want)
        trace = chrome_trace(engine.stop_profile(), plan)
    assert "<html" in render_report(trace).lower()
    return trace


def slices(trace: dict, prefix: str) -> dict[str, list[dict]]:
    """Slices named `prefix ...`, by their process's name."""
    processes = {
        e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"
    }
    found = defaultdict(list)
    for e in trace["traceEvents"]:
        if e["ph"] == "X" and e["name"].startswith(prefix + " "):
            found[processes[e["pid"]]].append(e)
    return found


def test_admission_and_queueing_precede_the_request_s_first_put(trace):
    admits, queued = slices(trace, "admit")["frontend"], slices(trace, "queued")["frontend"]
    assert [e["args"]["request"] for e in admits] == IDS
    assert [e["args"]["request"] for e in queued] == IDS
    puts = slices(trace, "put")["frontend"]
    for admit, wait in zip(admits, queued, strict=True):
        first_put = min(p["ts"] for p in puts if p["args"]["request"] == admit["args"]["request"])
        assert admit["ts"] <= wait["ts"] <= first_put
        assert admit["ts"] + admit["dur"] <= wait["ts"] + 1e-3  # the queueing follows the check
    tracks = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert "admission" in tracks


def test_adapters_and_map_chains_are_slices_where_they_run(trace):
    adapts, maps = slices(trace, "adapt"), slices(trace, "map")
    # One slice per chunk and request, where the transform runs (see ADAPTED).
    assert set(adapts) == {"a"} and set(maps) == {"frontend"}
    assert {e["name"] for e in adapts["a"]} == {"adapt a.out->b.in"}
    assert {e["name"] for e in maps["frontend"]} == {"map x.out->a.in", "map b.out->y.in"}
    assert {e["args"]["request"] for e in maps["frontend"]} == set(IDS)
    puts = {
        (e["name"].split(" ", 1)[1], e["args"]["request"], e["args"]["chunk"]): e
        for found in slices(trace, "put").values()
        for e in found
    }
    takes = {
        (e["name"].split(" ", 1)[1], e["args"]["request"], e["args"]["chunk"]): e
        for found in slices(trace, "take").values()
        for e in found
    }
    for e in [*adapts["a"], *maps["frontend"]]:
        channel = e["name"].split(" ", 1)[1]
        key = (channel, e["args"]["request"], e["args"]["chunk"])
        if channel == "b.out->y.in":  # the consumer's side: after the take
            assert takes[key]["ts"] <= e["ts"]
        else:  # the producer's side: before the put
            assert e["ts"] + e["dur"] <= puts[key]["ts"] + 1e-3
    per_request = defaultdict(int)
    for e in adapts["a"]:
        per_request[e["args"]["request"]] += 1
    assert per_request == dict.fromkeys(IDS, 2)  # 16 rows in chunks of 8
