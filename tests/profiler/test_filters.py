"""`engine.start_profile(stages=..., requests=...)`: a narrowed profile records only the
stages asked for (their steps and the chunks on the channels into and out of them) and only
the requests whose ids start with a prefix asked for; a stage the plan lacks is refused."""

import pytest

from omniflow.compiler import compile_source
from omniflow.profiler.report import render_report
from omniflow.profiler.trace import chrome_trace
from omniflow.runtime.engine import Engine
from omniflow.runtime.gpu_timeline import ProfileError
from tests.profiler.helpers import SPLIT


@pytest.fixture(scope="module")
def engine():
    plan = compile_source(SPLIT, "split.omni")
    with Engine(plan, "process") as engine:  # the filters travel in the Profile message
        yield engine


def profiled(engine, ids: list[str], **narrowed) -> list[dict]:
    """The events of a narrowed profile of `ids`; its report renders."""
    engine.start_profile(**narrowed)
    for i, rid in enumerate(ids):
        engine.generate({"x": [[i], [i + 1], [i + 2]]}, request_id=rid)
    trace = chrome_trace(engine.stop_profile(), engine.plan)
    assert "<html" in render_report(trace).lower()
    return trace["traceEvents"]


def recorded(events: list[dict]) -> tuple[set[str], set[str], set[str]]:
    """The stages that stepped, the channels chunks were put on or taken from, and every
    request the events name."""
    steps = [e for e in events if e["name"].endswith(" step")]
    chunks = [e for e in events if e["name"].startswith(("put ", "take "))]
    requests = {c["request"] for s in steps for c in s["args"]["calls"]}
    requests |= {e["args"]["request"] for e in chunks}
    requests |= {e["name"].split(" ", 1)[1] for e in events if e["name"].startswith("start ")}
    return (
        {e["name"].removesuffix(" step") for e in steps},
        {e["name"].split(" ", 1)[1] for e in chunks},
        requests,
    )


def test_a_stage_filter_records_that_stage_and_its_channels_only(engine):
    events = profiled(engine, ["s0", "s1"], stages=["c"])
    stages, channels, requests = recorded(events)
    around_c = {
        ch.name for ch in engine.plan.channels if ch.kind != "local" and "c" in (ch.src, ch.dst)
    }
    assert stages == {"c"}
    assert channels == around_c
    assert requests == {"s0", "s1"}
    starts = {e["id"] for e in events if e["ph"] == "s"}
    assert starts and starts == {e["id"] for e in events if e["ph"] == "f"}  # both ends kept


def test_a_request_filter_matches_id_prefixes(engine):
    events = profiled(engine, ["keep-0", "drop-0", "keep-1", "other"], requests=["keep-", "oth"])
    stages, channels, requests = recorded(events)
    assert requests == {"keep-0", "keep-1", "other"}
    assert stages == {s.name for s in engine.plan.stages}
    assert channels == {ch.name for ch in engine.plan.channels if ch.kind != "local"}
    # A step is kept only with a profiled request in it, and lists only those.
    for step in (e for e in events if e["name"].endswith(" step")):
        assert step["args"]["calls"] and step["args"]["batch"] >= len(step["args"]["calls"])


def test_both_filters_at_once_and_an_unknown_stage(engine):
    stages, channels, requests = recorded(
        profiled(engine, ["a0", "b0"], stages=["a"], requests=["b"])
    )
    assert stages == {"a"} and requests == {"b0"}
    assert channels == {ch.name for ch in engine.plan.channels if ch.dst == "a"}
    with pytest.raises(ProfileError, match=r"no stage 'nope'.*its stages: a, b, c") as refused:
        engine.start_profile(stages=["a", "nope"])
    assert refused.value.param == "stages"
