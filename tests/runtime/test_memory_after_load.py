"""What an executor process says of its GPU once its stages loaded (`control.Memory`): torch's
reserved bytes beside the budgets the plan gave its stages there, one line for a person
watching the start; off CUDA it says nothing. And what its start took (`control.Started`,
before its stages load): its Python's start and imports, its CUDA contexts. The `gpu` test
checks a tiny graph's loads on cuda:0 against the plan's total for that GPU (its stages'
budgets and CUDA contexts)."""

from pathlib import Path

import pytest
import torch

from omniflow.compiler import compile_file, compile_source
from omniflow.devices import GiB
from omniflow.runtime import control
from omniflow.runtime.budgets import gpu_memory, memory_after_load
from omniflow.runtime.engine import Engine
from tests.runtime.test_loading import THREE

GRAPHS = Path(__file__).parents[2] / "graphs"
no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has the GPU")


def test_the_memory_line_says_reserved_beside_planned_and_the_gpus_use():
    sent = control.Memory(
        "thinker+talker", "cuda:0", 40 * GiB, 12 * GiB + GiB // 2, 11 * GiB, 14 * GiB
    )
    said = control.decode(control.encode(sent))
    assert said == sent and isinstance(said, control.StartupReport)
    assert said.lines(f"omni_chat/{said.about}") == [
        "omni_chat/thinker+talker on cuda:0: torch reserved 12.5 GiB (11.0 GiB in tensors) of "
        "the 40.0 GiB planned for its stages; the GPU has 14.0 GiB in use (every process, CUDA "
        "contexts included)"
    ]


def test_the_started_line_says_what_the_process_start_took():
    sent = control.Started("thinker+talker", 4.25, 7.5)
    said = control.decode(control.encode(sent))
    assert said == sent and isinstance(said, control.StartupReport)
    assert said.lines(f"omni_chat/{said.about}") == [
        "omni_chat/thinker+talker started: Python and imports 4.2 s, CUDA context 7.5 s"
    ]
    assert control.Started("a", 1.0, 0.0).lines("p/a") == ["p/a started: Python and imports 1.0 s"]
    assert control.Started("a", None, 0.0).lines("p/a") == []  # a Ray actor's, on the CPU


@no_gpu
def test_off_cuda_an_executor_says_nothing_of_memory():
    """A GPU plan started where its GPU is absent: it says Started (no CUDA context made),
    then every stage Loaded, and no Memory."""
    plan = compile_source(THREE, "three.omni", devices="1xH200")
    (program,) = plan.executors
    assert gpu_memory("cuda:0") is None and gpu_memory("cpu") is None
    assert memory_after_load(program) == []
    said: list[control.StartupReport] = []
    with Engine(plan, "process", backends="standin", on_loaded=said.append) as engine:
        assert engine.generate({"x": [[1, 2]]})["y"].flatten().tolist() == [1, 2]
    started, *loaded = said
    assert isinstance(started, control.Started) and started.about == program.name
    assert 0 < started.python < 60 and started.cuda == 0
    assert sorted(m.about for m in loaded) == ["broken", "quick", "slow"]
    assert all(isinstance(m, control.Loaded) for m in loaded)


@pytest.mark.gpu
def test_what_a_tiny_graph_reserves_on_its_gpu_is_within_the_plans_total():
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    plan = compile_file(GRAPHS / "tts.omni", devices="1xH200", tiny=True)
    (gpu,) = plan.devices
    *_, before = gpu_memory("cuda:0")  # what this test process and any other hold already
    said: list[control.StartupReport] = []
    with Engine(plan, "process", on_loaded=said.append):
        pass
    memory = [m for m in said if isinstance(m, control.Memory)]
    assert {m.executor for m in memory} == {p.name for p in plan.executors}
    assert {m.device for m in memory} == {"cuda:0"}
    for report in memory:
        budgets = sum(plan.stage(s).budget_bytes for s in plan.program(report.executor).stage_names)
        assert 0 < report.allocated <= report.reserved <= report.planned == budgets
        assert report.used >= report.reserved
    # Torch's pools are within the stages' budgets; what the executors added to the GPU's
    # use, their contexts too, within the plan's total for it.
    assert sum(m.reserved for m in memory) <= gpu.total_bytes - gpu.contexts * gpu.context_bytes
    assert 0 < max(m.used for m in memory) - before <= gpu.total_bytes
