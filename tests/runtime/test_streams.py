"""The stages of one GPU in one executor: each on a CUDA stream at the plan's priority, hand-offs
between them ordered on the GPU, each stage's load held to its own budget.

On a machine without CUDA only the wiring runs (a GPU plan's loop runs its stages in program
order, the budget check itself); the `gpu` tests are the behaviour, and run where a GPU is."""

import pytest
import torch

from omniflow.compiler import compile_source
from omniflow.errors import OmniflowError
from omniflow.runtime.budgets import OverBudget, check_budget, load_within_budget
from omniflow.runtime.engine import Engine, RequestFailed
from omniflow.runtime.loop import ProgramLoop
from omniflow.runtime.streams import PROGRAM_ORDER, CudaStageStream
from tests.runtime.test_failures import (  # noqa: F401 (no_leaks: a fixture)
    no_leaks,
    two_text_stages_on_one_gpu,
    wait_until,
)

MiB = 1 << 20
CHAIN = """pipeline chain {
  stage src = python(fn=tests.runtime.stages.FN, inputs="n:text", outputs="out:tokens")
  stage dst = python(fn=tests.runtime.stages.double, inputs="in:tokens", outputs="out:tokens")
  input n: text -> src
  src.out -> dst [stream, chunk=1]
  dst.out -> output out [stream]
}"""


def chain(fn: str = "counter", devices: str = "1xH200"):
    return compile_source(CHAIN.replace("FN", fn), "chain.omni", devices=devices)


def test_the_plan_gives_each_stage_of_a_gpu_executor_a_stream_priority():
    (program,) = chain().executors
    assert program.stream_priorities == {"src": 0, "dst": -1}  # dst writes the output
    (cpu,) = [p for p in chain(devices="cpu").executors if p.name == "src+dst"]
    assert cpu.stream_priorities == {}  # off GPUs: no streams


def test_without_its_gpu_a_gpu_program_runs_its_stages_in_program_order():
    if torch.cuda.is_available():
        pytest.skip("this machine has the GPU")
    loop = ProgramLoop(chain().executors[0])
    try:
        assert {name: r.stream for name, r in loop.runners.items()} == {
            "src": PROGRAM_ORDER,
            "dst": PROGRAM_ORDER,
        }
    finally:
        loop.close()


def test_a_stage_over_its_budget_is_named_and_one_within_or_unbudgeted_passes():
    stage = chain().stage("src")
    stage.budget_bytes, stage.need_bytes = 16 * MiB, 8 * MiB
    with pytest.raises(OverBudget) as info:
        check_budget(stage, "cuda:0", 64 * MiB)
    message = str(info.value)
    assert "stage 'src' took 64.0 MiB of cuda:0 to load, over its budget of 16.0 MiB" in message
    assert "needs 8.0 MiB" in message and "memory=" in message
    check_budget(stage, "cuda:0", 16 * MiB)
    stage.budget_bytes = 0  # placement planned nothing for it: nothing to hold it to
    check_budget(stage, "cuda:0", 64 * MiB)


def test_a_load_off_cuda_is_measured_as_nothing():
    stage = chain(devices="cpu").stage("src")
    stage.budget_bytes = 1
    loaded = load_within_budget(stage, "cpu", lambda: torch.zeros(1 << 16))
    assert loaded.shape == (1 << 16,)  # host memory is no GPU budget's


@pytest.mark.gpu
def test_each_stage_runs_on_its_own_stream_at_its_priority():
    loop = ProgramLoop(chain().executors[0])
    try:
        src, dst = (loop.runners[s].stream for s in ("src", "dst"))
        assert isinstance(src, CudaStageStream) and isinstance(dst, CudaStageStream)
        assert src.stream != dst.stream
        assert dst.stream.priority <= src.stream.priority  # nearer the output: runs first
        low, high = torch.cuda.Stream.priority_range()
        if low != high:  # a GPU with priorities at all
            assert dst.stream.priority < src.stream.priority
    finally:
        loop.close()


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["inprocess", "process"])
def test_a_hand_off_between_streams_waits_for_the_producers_kernels(mode):
    # Each value is written behind a long GPU sleep on the producer's stream; the consumer's
    # stream doubles it. Read before it was written, a value would be garbage.
    with Engine(chain("late_on_gpu"), mode) as engine:
        out = engine.generate({"n": "24"})["out"]
    assert out.flatten().tolist() == [2 * i for i in range(24)]


@pytest.mark.gpu
def test_a_stage_over_its_budget_stops_its_executor_naming_it():
    # The small stage's share of the device is about 18 MiB; its module takes 64 MiB at load.
    plan = compile_source(
        """pipeline p {
          stage hungry = python(fn=tests.runtime.hungry_stage.passthrough, memory="16MiB")
          stage big = python(fn=omniflow.runtime.builtin_stages.identity, memory="800MiB")
          input x: tokens -> hungry
          hungry.out -> big [stream, chunk=8]
          big.out -> output y
        }""",
        "p.omni",
        devices="cuda:0=2GiB",
    )
    assert plan.stage("hungry").budget_bytes < 64 * MiB
    with pytest.raises(OmniflowError, match="stage 'hungry' took 64.0 MiB of cuda:0 to load"):
        Engine(plan, "process")


@pytest.mark.gpu
def test_a_step_that_breaks_the_gpus_context_restarts_the_executor_with_all_its_stages(
    no_leaks,  # noqa: F811
):
    plan = two_text_stages_on_one_gpu("break_gpu_on_boom")
    (executor,) = plan.executors
    with Engine(plan, "process") as engine:
        before = engine.executor_pids[executor.name]
        with pytest.raises(RequestFailed, match="broke the CUDA context"):
            engine.generate({"prompt": "boom"})
        wait_until(lambda: engine.executor_pids[executor.name] != before)
        assert engine.generate({"prompt": "fine"})["out"] == "FINE"  # both stages are back
