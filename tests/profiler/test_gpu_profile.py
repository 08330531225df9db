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
from omniflow.runtime.gpu_timeline import KernelTimeline, ProfileError
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
    for (_name, start, dur, _device), (before, after) in zip(ops, windows, strict=True):
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
    assert (GPU_TRACK, f"gpu {ops[0][3]}: kernels") in names
    slices = [e for e in trace if e["ph"] == "X" and e["tid"] == GPU_TRACK]
    assert len(slices) == len(ops) and min(e["ts"] for e in slices) >= began / 1e3


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
