"""An executor's torch threads: the engine's for CPU stages (a seed replays bit for bit in
every run mode), one for an executor whose stages all run on CUDA."""

from pathlib import Path

from omniflow.compiler import compile_file
from omniflow.runtime.executor import torch_threads

OMNI_CHAT = Path(__file__).parents[2] / "graphs" / "omni_chat.omni"


def test_cpu_executors_keep_the_engines_threads():
    plan = compile_file(OMNI_CHAT, "cpu", tiny=True)
    for program in plan.executors:
        assert torch_threads(program, 7) == 7
        assert torch_threads(program, None) is None


def test_gpu_executors_run_torch_at_one_thread():
    for devices in ("1xH200", "2xH200", "node0=1xH200,node1=1xH200"):
        plan = compile_file(OMNI_CHAT, devices)
        assert plan.executors
        for program in plan.executors:
            assert torch_threads(program, None) == 1
            assert torch_threads(program, 16) == 1
