"""`--profile-gpu`: the torch profiler's timeline merged into the trace on the profile's
clock. Without CUDA, the same profiler's CPU ops exercise the clock alignment and the merge;
asking a CPU plan for a GPU profile is a clear error; the kernel track itself needs a GPU."""

import time

import pytest
import torch

from omniflow.compiler import compile_source
from omniflow.profiler.trace import GPU_TRACK, chrome_trace
from omniflow.runtime.control import Profiled
from omniflow.runtime.engine import Engine
from omniflow.runtime.gpu_timeline import KernelTimeline, ProfileError, named_streams
from tests.gpu_wiring import stages_on_cpu

GPU_CHAIN = """pipeline gpu {
  stage a = python(fn=tests.profiler.stages.double_on_gpu, max_batch=4)
  stage b = python(fn=omniflow.runtime.builtin_stages.identity, max_batch=4)
  input x: tokens -> a
  a.out -> b.in [stream, chunk=2]
  b.out -> output y [stream]
}"""


def test_the_torch_profilers_events_land_between_the_monotonic_readings_around_them():
    timeline = KernelTimeline("cpu")
    timeline.start()
    windows = []
    for _ in range(3):
        before = time.monotonic_ns()
        torch.randn(64, 64) @ torch.randn(64, 64)
        windows.append((before, time.monotonic_ns()))
    ops = [k for k in timeline.stop() if k[0] == "aten::matmul"]
    assert len(ops) == 3
    for (_name, start, dur, _device, _stream), (before, after) in zip(ops, windows, strict=True):
        assert before <= start and start + dur <= after


def test_the_timeline_becomes_a_track_of_its_executor_in_the_trace():
    timeline = KernelTimeline("cpu")
    timeline.start()
    began = time.monotonic_ns()
    torch.ones(8).sum()
    ops = timeline.stop()
    profile = Profiled("a", ["a"], [], b"", kernels=ops)
    trace = chrome_trace([profile], "p")["traceEvents"]
    names = {(e["tid"], e["args"]["name"]) for e in trace if e["name"] == "thread_name"}
    assert (GPU_TRACK, f"gpu {ops[0][3]} stream {ops[0][4]}: kernels") in names
    slices = [e for e in trace if e["ph"] == "X" and e["tid"] == GPU_TRACK]
    assert len(slices) == len(ops) and min(e["ts"] for e in slices) >= began / 1e3


def test_each_stream_is_a_track_named_by_its_stage_so_their_overlap_shows():
    """Kernels of two stages' streams that overlap in time go on two tracks, each named by
    its stage (the streams' stages first); a stream no stage was found for keeps its id."""
    kernels = [
        ("talker step", 1_000, 5_000, 0, 7),
        ("code2wav window", 2_000, 3_000, 0, 13),
        ("talker step", 6_500, 5_000, 0, 7),
        ("memcpy", 3_000, 100, 0, 21),
    ]
    profile = Profiled("gpu0", ["talker"], [], b"", kernels=kernels, streams=[(13, "code2wav")])
    profile.streams.append((7, "talker"))
    trace = chrome_trace([profile], "p")["traceEvents"]
    names = {e["args"]["name"]: e["tid"] for e in trace if e["name"] == "thread_name"}
    assert names["gpu 0 stream 13: code2wav's kernels"] == GPU_TRACK  # stage order: by name
    talker, other = names["gpu 0 stream 7: talker's kernels"], names["gpu 0 stream 21: kernels"]
    assert len({GPU_TRACK, talker, other}) == 3
    slices = [e for e in trace if e["ph"] == "X"]
    by_track = {tid: [e for e in slices if e["tid"] == tid] for tid in (GPU_TRACK, talker)}
    assert [e["name"] for e in by_track[talker]] == ["talker step"] * 2
    (window,) = by_track[GPU_TRACK]
    first = by_track[talker][0]
    assert first["ts"] < window["ts"] < first["ts"] + first["dur"]  # they overlap


def test_a_stage_is_named_on_the_stream_whose_kernel_ran_in_its_mark():
    """`named_streams`: the stream of the kernel that began inside a stage's mark (the
    window a marker kernel ran alone in) is that stage's, checked on the CPU timeline (the
    recording thread is its "stream")."""
    timeline = KernelTimeline("cpu")
    timeline.start()
    before = time.monotonic_ns()
    torch.ones(4).sum()
    marks = [("a", before, time.monotonic_ns()), ("b", 0, 1)]  # b's window saw nothing
    kernels = timeline.stop()
    assert named_streams(kernels, marks) == {kernels[0][4]: "a"}


def test_the_markers_that_name_the_streams_are_not_in_the_timeline():
    """The marker each stage's stream runs when the profile starts names the stream but is
    no stage's work: `stop` leaves it out (on the GPU it ran before any step), keeping what
    ran after (the CPU timeline, a mark set as `start` sets it on CUDA)."""
    timeline = KernelTimeline("cpu")
    timeline.start()
    before = time.monotonic_ns()
    torch.ones(4).sum()
    timeline.marks.append(("a", before, time.monotonic_ns()))
    after = time.monotonic_ns()
    torch.ones(4).sum()
    kernels = timeline.stop()
    assert list(timeline.streams.values()) == ["a"]
    assert kernels and all(k[1] >= after for k in kernels)


def test_a_gpu_profile_of_a_plan_without_gpu_stages_is_a_clear_error():
    plan = compile_source(GPU_CHAIN, "gpu.omni")  # compiled for the CPU
    with (
        Engine(plan, "inprocess") as engine,
        pytest.raises(ProfileError, match=r"on the CPU \(compiled for devices cpu\)"),
    ):
        engine.start_profile(gpu=True)


def gpu_plan():
    """GPU_CHAIN compiled for one GPU: the stage that launches kernels is on it."""
    plan = compile_source(GPU_CHAIN, "gpu.omni", devices="cuda:0=8GiB")
    assert plan.stage("a").devices == ["cuda:0"]
    return plan


def test_the_gpu_tests_plan_loads_on_the_cpu():
    """Its stages load here (the GPU one's function imports; it runs only on CUDA)."""
    with stages_on_cpu(gpu_plan()) as stages:
        assert {name: type(b).__name__ for name, b in stages.items()} == {
            "a": "GeneratorBackend",
            "b": "GeneratorBackend",
        }


@pytest.mark.gpu
def test_a_gpu_stage_adds_its_cuda_kernels_on_the_profiles_clock():
    plan = gpu_plan()
    with Engine(plan, "process") as engine:
        engine.generate({"x": [[0]]})  # CUDA initialised, not profiled
        engine.start_profile(gpu=True)
        for i in range(3):
            engine.generate({"x": [[i], [i + 1]]}, request_id=f"r{i}")
        profiles = engine.stop_profile()
    trace = chrome_trace(profiles, plan)["traceEvents"]
    gpu = next(p for p in profiles if p.executor == plan.stage("a").executor)
    assert gpu.kernels, "the GPU stage's executor recorded no kernels"
    pid = next(
        e["pid"] for e in trace if e["name"] == "process_name" and e["args"]["name"] == gpu.executor
    )
    slices = [e for e in trace if e["ph"] == "X" and e["pid"] == pid]  # counters have no track
    kernels = [e for e in slices if e["tid"] == GPU_TRACK]
    steps = [e for e in slices if e["name"] == "a step"]
    assert kernels and steps
    # Same clock: every kernel runs while the stage's steps are being recorded, after the
    # first step that launched one began and before the last step's end.
    first, last = min(e["ts"] for e in steps), max(e["ts"] + e["dur"] for e in steps)
    assert all(first <= k["ts"] <= last for k in kernels)
    # The stage's stream is a track named by it.
    assert "a" in dict(gpu.streams).values()
    tracks = {e["args"]["name"] for e in trace if e["name"] == "thread_name" and e["pid"] == pid}
    assert any(name.endswith("a's kernels") for name in tracks)
