"""An executor's torch threads: the engine's for CPU stages (a seed replays bit for bit in
every run mode); for an executor whose stages all run on CUDA, its share of the host's CPUs
while its stages load (the host's executors load side by side) and one while it serves,
counted per node on a cluster."""

import os
from pathlib import Path

from omniflow.compiler import compile_file
from omniflow.runtime.executor import TorchThreads, torch_threads
from omniflow.runtime.transport import host_executors

OMNI_CHAT = Path(__file__).parents[2] / "graphs" / "omni_chat.omni"
CPUS = len(os.sched_getaffinity(0))


def test_cpu_executors_keep_the_engines_threads():
    plan = compile_file(OMNI_CHAT, "cpu", tiny=True)
    for program in plan.executors:
        assert torch_threads(program, 7, len(plan.executors)) == TorchThreads(7, 7)
        assert torch_threads(program, None, len(plan.executors)) == TorchThreads(None, None)


def test_gpu_executors_load_at_their_share_of_the_host_and_serve_at_one():
    plan = compile_file(OMNI_CHAT, "2xH200")  # one executor per GPU
    executors = plan.executors
    assert len(executors) == 2
    share = max(1, CPUS // len(executors))
    for program in executors:
        assert host_executors(plan, program.name) == len(executors)
        assert torch_threads(program, None, len(executors)) == TorchThreads(load=share, serve=1)
        assert torch_threads(program, 1, len(executors)).load == 1  # OMP_NUM_THREADS=1 holds
        assert torch_threads(program, 10_000, 1) == TorchThreads(load=CPUS, serve=1)


def test_executors_are_counted_on_their_own_node():
    plan = compile_file(OMNI_CHAT, "node0=1xH200,node1=1xH200")
    nodes = {}
    for program in plan.executors:
        nodes.setdefault(program.devices[0].partition("/")[0], []).append(program.name)
    assert len(nodes) == 2, nodes
    for names in nodes.values():
        for name in names:
            assert host_executors(plan, name) == len(names)
