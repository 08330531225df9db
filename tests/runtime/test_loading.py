"""An executor's stages loaded one after another or at once (a thread each): the loads
overlap and say so, a stage that fails while the others load fails the start naming it and
nothing it started is left open, and each stage's load is held to its own budget.

On a CPU machine a GPU plan's stages load here in program order, unmeasured; the loads'
faults are injected by wrapping the backend loader (`loading.load_backend`): a delay, an
error. The `gpu` tests measure concurrent loads in their allocator pools where a GPU is."""

import builtins
import importlib
import threading
import time

import pytest
import torch

from omniflow.compiler import compile_source
from omniflow.errors import OmniflowError
from omniflow.runtime import control, loading
from omniflow.runtime.budgets import OverBudget, load_in_own_pool
from omniflow.runtime.engine import Engine, EngineError
from omniflow.runtime.loop import ProgramLoop
from omniflow.runtime.streams import stage_streams
from tests.runtime.test_failures import no_leaks  # noqa: F401 (a fixture)

MiB = 1 << 20
# Two loads in allocator pools at once aborted the whole pytest process on an H200 (torch
# 2.11, 2026-12-05: "Fatal Python error: Aborted" as the first of the two GPU tests' loads
# left its pool, the other still in its own), taking the rest of the GPU suite with it: both
# tests wait until that is fixed (`--load parallel` is opt-in).
ABORTS = pytest.mark.skip(reason="two loads in pools at once aborted the process (torch 2.11)")
THREE = """pipeline three {
  stage slow = python(fn=omniflow.runtime.builtin_stages.identity)
  stage broken = python(fn=omniflow.runtime.builtin_stages.identity)
  stage quick = python(fn=omniflow.runtime.builtin_stages.identity)
  input x: tokens -> slow
  slow.out -> broken.in [stream, chunk=8]
  broken.out -> quick.in [stream, chunk=8]
  quick.out -> output y
}"""


def executor():
    """The one executor of three stages on one GPU (run here without it)."""
    (program,) = compile_source(THREE, "three.omni", devices="1xH200").executors
    assert program.stage_names == ["slow", "broken", "quick"]
    return program


def slow_stage():
    """The executor's first stage, "slow", its budget to be set."""
    (stage,) = (s for s in executor().stages if s.name == "slow")
    return stage


class Faults:
    """What the injected loader does per stage (`delays`, `errors`) and what it loaded and
    closed since."""

    def __init__(self, monkeypatch, delays: dict[str, float], errors: dict[str, Exception]):
        self.loaded: list[str] = []
        self.closed: list[str] = []
        real = loading.load_backend

        def load_backend(spec, device, backends):
            name = spec.plan.name
            time.sleep(delays.get(name, 0.0))
            if name in errors:
                raise errors[name]
            backend = real(spec, device, backends)
            close = backend.close
            backend.close = lambda: (self.closed.append(name), close())
            self.loaded.append(name)
            return backend

        monkeypatch.setattr(loading, "load_backend", load_backend)


def load_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("omniflow-load-")]


def timed_load(program, order: str) -> tuple[float, list[control.Loaded]]:
    said: list[control.Loaded] = []
    began = time.monotonic()
    loop = ProgramLoop(program, on_loaded=said.append, load=order)
    took = time.monotonic() - began
    loop.close()
    return took, said


def test_stages_loaded_at_once_overlap_and_say_how_long_they_ran_beside_each_other(monkeypatch):
    program = executor()
    Faults(monkeypatch, {"slow": 1.0, "broken": 1.0, "quick": 1.0}, {})
    one_by_one, said = timed_load(program, "sequential")
    assert one_by_one >= 3.0
    assert [m.stage for m in said] == ["slow", "broken", "quick"]  # in program order
    assert all(m.alongside == 0 for m in said)
    assert said[0].lines("p/slow") == [f"loaded p/slow in {said[0].seconds:.1f} s"]

    def patched():
        imports = (builtins.__import__, importlib.import_module)
        return (*imports, torch.cuda.synchronize, torch.cuda.empty_cache)

    before = patched()
    at_once, said = timed_load(program, "parallel")
    # Imports one at a time and device-wide calls between captures while loading at once,
    # not after.
    assert patched() == before
    assert at_once < one_by_one - 1.0  # three sleeps at once, on any machine
    assert sorted(m.stage for m in said) == ["broken", "quick", "slow"]
    for message in said:
        assert message.seconds >= 1.0
        assert message.alongside > 0.5 * message.seconds  # the others slept meanwhile
        assert "beside its executor's other stages" in message.lines("p/x")[0]
    assert load_threads() == []


@pytest.mark.parametrize("order", ["parallel", "sequential"])
def test_a_stage_that_fails_its_load_fails_the_start_naming_it_and_closes_the_others(
    monkeypatch, order
):
    faults = Faults(
        monkeypatch,
        {"slow": 0.5, "quick": 0.3},
        {"broken": OmniflowError("the checkpoint is truncated")},
    )
    said: list[control.Loaded] = []
    with pytest.raises(OmniflowError, match="stage 'broken' could not load") as info:
        ProgramLoop(executor(), on_loaded=said.append, load=order)
    assert "the checkpoint is truncated" in str(info.value)
    # Loaded at once, the slow stage was still loading when the fault struck: it finished,
    # and was closed with every other stage that loaded, before the start failed.
    assert sorted(faults.closed) == sorted(faults.loaded)
    assert "slow" in faults.loaded
    assert load_threads() == []
    # Loaded at once, the others ended after the fault: the start had failed, none is said.
    assert [m.stage for m in said] == (["slow"] if order == "sequential" else [])


def test_an_unexpected_exception_in_a_concurrent_load_is_raised_as_it_is_with_its_stage_noted(
    monkeypatch,
):
    faults = Faults(monkeypatch, {"slow": 0.5, "quick": 0.2}, {"broken": RuntimeError("bug")})
    with pytest.raises(RuntimeError, match="bug") as info:
        ProgramLoop(executor(), load="parallel")
    assert "(raised while stage 'broken' loaded)" in info.value.__notes__
    assert sorted(faults.closed) == ["quick", "slow"]
    assert load_threads() == []


def test_an_unknown_load_order_is_one_clear_error():
    with pytest.raises(EngineError, match="unknown load 'lazy'; use 'auto' or 'sequential'"):
        Engine(compile_source(THREE, "three.omni"), "inprocess", load="lazy")


@pytest.mark.parametrize("mode", ["inprocess", "process"])
def test_an_executor_whose_stage_cannot_load_at_once_with_the_others_is_one_clear_error(
    mode,
    no_leaks,  # noqa: F811
):
    broken = THREE.replace(
        "stage broken = python(fn=omniflow.runtime.builtin_stages.identity)",
        "stage broken = python(fn=tests.runtime.stages.no_such_function)",
    )
    plan = compile_source(broken, "three.omni", devices="1xH200")
    with pytest.raises(OmniflowError, match="stage 'broken' could not load: cannot import"):
        Engine(plan, mode, backends="standin", load="parallel")
    assert load_threads() == []


@pytest.mark.parametrize("mode", ["inprocess", "process"])
def test_an_engine_loads_its_executors_stages_at_once_and_serves(mode):
    plan = compile_source(THREE, "three.omni", devices="1xH200")
    with Engine(plan, mode, backends="standin", load="parallel") as e:
        assert e.generate({"x": [[1, 2, 3]]})["y"].flatten().tolist() == [1, 2, 3]


def test_auto_loads_one_after_another_where_no_stage_has_a_cuda_stream():
    if torch.cuda.is_available():
        pytest.skip("this machine has the GPU")
    program = executor()
    streams = stage_streams(program)
    assert loading.load_order(program, streams, "auto") == "sequential"
    assert loading.load_order(program, streams, "parallel") == "parallel"


@pytest.mark.gpu
@ABORTS
def test_two_stages_loading_at_once_on_one_gpu_are_each_measured_alone():
    # Each load allocates, then waits until the other has allocated too, so the two loads
    # hold their memory at the same time; each is measured as its own.
    stage = slow_stage()
    stage.budget_bytes, stage.need_bytes = 48 * MiB, 40 * MiB
    both = threading.Barrier(2, timeout=30)
    held, failures = {}, {}

    def load(size: int):
        tensor = torch.empty(size, dtype=torch.uint8, device="cuda:0")
        both.wait()
        return tensor

    def run(size: int) -> None:
        try:
            held[size] = load_in_own_pool(stage, "cuda:0", lambda: load(size), lambda t: None)
        except OverBudget as err:
            failures[size] = str(err)

    threads = [threading.Thread(target=run, args=(size,)) for size in (16 * MiB, 64 * MiB)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    (tensor, pool) = held[16 * MiB]
    assert tensor.numel() == 16 * MiB and pool.held() == 16 * MiB
    assert list(failures) == [64 * MiB]  # 64 MiB is over the 48 MiB budget, 16 is not
    assert "stage 'slow' took 64.0 MiB of cuda:0 to load" in failures[64 * MiB]


@pytest.mark.gpu
@ABORTS
def test_a_graph_captured_while_another_stage_loads_counts_to_its_own_load():
    # One load captures a CUDA graph whose output takes 8 MiB while the other copies
    # weights in from the host: the capture is intact and its graph pool is its load's.
    from omniflow.backends.cuda_graphs import capture_graph

    stage = slow_stage()
    stage.budget_bytes = 0
    copying = threading.Event()
    out = {}

    def capture():
        buffer = torch.ones(2 * MiB, device="cuda:0")  # 8 MiB of float32
        copying.wait(timeout=30)
        graph, made = capture_graph(lambda: buffer * 2, None, torch.cuda.Stream("cuda:0"))
        graph.replay()
        return made

    def copy_weights():
        copying.set()
        return [torch.randn(MiB).to("cuda:0") for _ in range(32)]  # 4 MiB each, synced

    def run(name, fn):
        out[name] = load_in_own_pool(stage, "cuda:0", fn, lambda loaded: None)

    threads = [
        threading.Thread(target=run, args=("capture", capture)),
        threading.Thread(target=run, args=("copy", copy_weights)),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    made, pool = out["capture"]
    torch.cuda.synchronize()
    assert made.eq(2).all()
    assert pool.held() == 16 * MiB  # the buffer, and the graph's output in its graph pool
    weights, pool = out["copy"]
    assert len(weights) == 32 and pool.held() == 128 * MiB
