"""A profile of real requests through executor processes is a valid Chrome trace: one process
per executor, a track per stage, every chunk's put joined to its take by a flow arrow that
goes forward in time, request ids and sizes in the args, counters of chunks in flight and
requests held, and the plan in `otherData`."""

import json
from collections import Counter

import pytest

from omniflow.compiler import compile_source
from omniflow.plan import Plan
from omniflow.profiler.trace import chrome_trace, write_trace
from omniflow.runtime.engine import Engine
from tests.profiler.helpers import identity_chain

CHAIN = identity_chain("chain", 4, 1, 2)


@pytest.fixture(scope="module", params=["inprocess", "process"])
def profiled(request):
    plan = compile_source(CHAIN, "chain.omni")
    with Engine(plan, request.param) as engine:
        engine.generate({"x": [[0]]})  # not profiled
        engine.start_profile()
        ids = [f"r{i}" for i in range(4)]
        for i, rid in enumerate(ids):
            engine.generate({"x": [[i], [i + 1], [i + 2]]}, request_id=rid)
        profiles = engine.stop_profile()
    return plan, ids, profiles


def test_the_trace_has_a_process_per_executor_and_a_track_per_stage(profiled):
    plan, _ids, profiles = profiled
    trace = chrome_trace(profiles, plan.pipeline)
    meta = [e for e in trace["traceEvents"] if e["ph"] == "M"]
    processes = {e["args"]["name"] for e in meta if e["name"] == "process_name"}
    assert processes == {p.name for p in plan.programs}
    tracks = {e["args"]["name"] for e in meta if e["name"] == "thread_name"}
    assert {s.name for s in plan.stages} <= tracks


def test_every_event_is_well_formed_and_every_flow_ends_after_it_starts(profiled):
    plan, ids, profiles = profiled
    events = chrome_trace(profiles, plan.pipeline)["traceEvents"]
    for e in events:
        assert e["ph"] in "XMsfiC" and isinstance(e["pid"], int)
        if e["ph"] == "X":
            assert e["dur"] > 0 and e["ts"] > 0
    starts = {e["id"]: e["ts"] for e in events if e["ph"] == "s"}
    ends = {e["id"]: e["ts"] for e in events if e["ph"] == "f"}
    assert starts and starts.keys() == ends.keys()
    assert all(ends[i] >= starts[i] for i in starts)
    # Each profiled request's chunks crossed every channel, and only profiled requests appear.
    crossing = Counter(e["args"]["request"] for e in events if e["name"].startswith("put "))
    assert set(crossing) == set(ids)
    shared = [c for c in plan.channels if c.kind != "local"]
    assert all(n >= len(shared) for n in crossing.values())


def test_steps_name_their_batch_and_the_trace_file_loads(profiled, tmp_path):
    plan, ids, profiles = profiled
    steps = [e for e in chrome_trace(profiles)["traceEvents"] if e["name"].endswith(" step")]
    assert steps and all(s["args"]["batch"] == len(s["args"]["calls"]) for s in steps)
    assert {c["request"] for s in steps for c in s["args"]["calls"]} == set(ids)
    path = write_trace(profiles, tmp_path / "trace.json", plan.pipeline)
    assert json.loads(path.read_text())["otherData"]["pipeline"] == "chain"


def test_counters_never_go_negative_and_return_to_zero(profiled):
    plan, _ids, profiles = profiled
    counters = [e for e in chrome_trace(profiles)["traceEvents"] if e["ph"] == "C"]
    last: dict = {}
    for e in counters:
        (value,) = e["args"].values()
        assert value >= 0
        last[e["pid"], e["name"]] = value
    names = {name for _pid, name in last}
    shared = {c.name for c in plan.channels if c.kind != "local"}
    assert names == {f"in flight {c}" for c in shared} | {f"requests {s.name}" for s in plan.stages}
    assert set(last.values()) == {0}  # every chunk was taken, every request ended


def test_the_plan_travels_in_the_trace(profiled, tmp_path):
    plan, _ids, profiles = profiled
    path = write_trace(profiles, tmp_path / "trace.json", plan)
    other = json.loads(path.read_text())["otherData"]
    assert other["pipeline"] == "chain"
    assert Plan.from_json(json.dumps(other["plan"])) == plan
