"""An executor's torch threads: the engine's for CPU stages (a seed replays bit for bit in
every run mode); for an executor whose stages all run on CUDA, the engine's while its
stages load and one while it serves."""

from pathlib import Path

from omniflow.compiler import compile_file
from omniflow.runtime.executor import TorchThreads, torch_threads

OMNI_CHAT = Path(__file__).parents[2] / "graphs" / "omni_chat.omni"


def test_cpu_executors_keep_the_engines_threads():
    plan = compile_file(OMNI_CHAT, "cpu", tiny=True)
    for program in plan.executors:
        assert torch_threads(program, 7) == TorchThreads(load=7, serve=7)
        assert torch_threads(program, None) == TorchThreads(load=None, serve=None)


def test_gpu_executors_load_at_the_engines_threads_and_serve_at_one():
    for devices in ("1xH200", "2xH200", "node0=1xH200,node1=1xH200"):
        plan = compile_file(OMNI_CHAT, devices)
        assert plan.executors
        for program in plan.executors:
            assert torch_threads(program, None) == TorchThreads(load=None, serve=1)
            assert torch_threads(program, 16) == TorchThreads(load=16, serve=1)
