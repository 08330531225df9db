"""Pass: stage fusion, the executor rule. `meta["executor"]` names each node's executor
(inputs and outputs live in the `frontend`), and `graph.meta["executors"]` lists them
(`ExecutorGroup`) with why each was formed, why its neighbours were kept apart, and the CUDA
stream priority of each of its stages.

- On GPUs, the stages placed on one device set share one executor process: one CUDA
  context and one allocator pool per GPU, every hand-off between them a reference (`local`)
  instead of an IPC round trip (~0.1-0.8 ms), and no time-slicing between contexts (the
  processes of one GPU take turns on it: it runs one context at a time without MPS). Each
  stage runs on its own CUDA stream, so one stage's kernels overlap another's; the stage
  nearest the listener gets the highest priority (`stream_priorities`). A stage that asks
  (`isolate=true`) keeps a process of its own: its host work (a Python function, a
  tokenizer) would hold the interpreter lock the other stages' steps need to launch.
- Off GPUs (stages on `cpu`) separate processes do run in parallel, one per core: only
  stages joined by a per-token stream share a process (each hand-off would otherwise cost
  an IPC round trip per token); a chunked or whole-output edge stays a process boundary.
"""

from __future__ import annotations

from omniflow.ir.graph import OUTPUT, Edge, Graph
from omniflow.passes.common import (
    PER_TOKEN_CHUNK,
    DisjointSets,
    Target,
    isolated,
    on_gpus,
    shares_gpu_process,
)
from omniflow.passes.facts import ExecutorGroup
from omniflow.plan import FRONTEND

READS = ("placement",)
WRITES = ("executor", "executors")

_ON_GPU = (
    "one process per GPU: the stages on {devices} share its CUDA context and allocator pool, "
    "each on its own CUDA stream, hand-offs ordered by CUDA events"
)
_ISOLATED = (
    "isolate=true: a process of its own, so that its host work does not hold the interpreter "
    "lock the other stages' steps need"
)


def _devices(graph: Graph, name: str) -> tuple[str, ...]:
    return graph.node(name).meta["placement"].devices


def _per_token_on_cpu(graph: Graph, edge: Edge) -> bool:
    """An edge that fuses its ends off GPUs: a per-token stream between stages on one device."""
    src, dst = graph.node(edge.src), graph.node(edge.dst)
    return (
        src.is_stage
        and not on_gpus(_devices(graph, src.name))
        and dst.is_stage
        and not (isolated(graph, src) or isolated(graph, dst))
        and isinstance(edge.chunk, int)
        and edge.chunk <= PER_TOKEN_CHUNK
        and _devices(graph, src.name) == _devices(graph, dst.name)
    )


def split_reason(graph: Graph, edge: Edge) -> str:
    """Why `edge`'s two stages run in different processes."""
    ends = _devices(graph, edge.src), _devices(graph, edge.dst)
    if ends[0] != ends[1]:
        return f"on different devices ({'/'.join(ends[0])} vs {'/'.join(ends[1])})"
    apart = [n for n in (edge.src, edge.dst) if isolated(graph, graph.node(n))]
    if apart:
        return f"{' and '.join(apart)} asked for a process of its own (isolate=true)"
    where = "/".join(ends[0])
    if edge.chunk is None:
        return f"whole-output edge on {where}: separate processes run in parallel on its cores"
    return (
        f"chunked stream (chunk={edge.chunk}) on {where} amortizes the hop; separate processes "
        "run in parallel on its cores"
    )


def hops_to_outputs(graph: Graph) -> dict[str, int]:
    """Per stage, the most stages its work still passes through before it reaches a pipeline
    output: 0 for a stage that writes only outputs (a vocoder), one more per stage in line
    after it on its longest path (a talker 1, a thinker 2, its encoders 3). The fewer, the
    nearer the listener: its stream runs at a higher priority."""
    hops: dict[str, int] = {}
    for node in reversed(graph.topo_order()):
        if node.is_stage:
            after = [
                0 if graph.node(e.dst).op == OUTPUT else hops[e.dst] + 1
                for e in graph.out_edges(node.name)
            ]
            hops[node.name] = max(after, default=0)
    return hops


def stream_priorities(stages: list[str], hops: dict[str, int]) -> tuple[int, ...]:
    """Each stage's CUDA stream priority, as CUDA orders them (lower runs first): 0 for the
    stages of the executor farthest from the outputs, one less per step nearer. torch maps a
    priority beyond the device's range to its nearest (six levels on an H200)."""
    levels = sorted({hops[s] for s in stages}, reverse=True)
    return tuple(-levels.index(hops[s]) for s in stages)


def fuse_stages(graph: Graph, target: Target) -> Graph:
    graph = graph.copy()
    groups = DisjointSets(n.name for n in graph.stages)
    shared_gpu: dict[tuple[str, ...], str] = {}  # device set -> a stage of its shared process
    for node in graph.stages:
        devices = _devices(graph, node.name)
        if shares_gpu_process(graph, node, devices):
            groups.union(shared_gpu.setdefault(devices, node.name), node.name)
    for edge in graph.edges:
        if _per_token_on_cpu(graph, edge):
            groups.union(edge.src, edge.dst)
    hops = hops_to_outputs(graph)
    reasons: dict[str, list[str]] = {}
    executors = []
    for names in groups.sets(n.name for n in graph.topo_order() if n.is_stage):
        name = "+".join(names)
        devices = _devices(graph, names[0])
        for n in names:
            graph.node(n).meta["executor"] = name
        gpu = on_gpus(devices)
        if gpu and isolated(graph, graph.node(names[0])):
            reasons[name] = [_ISOLATED]
        elif gpu:
            reasons[name] = [_ON_GPU.format(devices="/".join(devices))]
        else:
            inside = [e for e in graph.edges if e.src in names and e.dst in names]
            reasons[name] = [
                f"fused: {e.name} streams chunk={e.chunk} on one device" for e in inside
            ]
        priorities = stream_priorities(names, hops) if gpu else ()
        executors.append((name, devices, tuple(names), priorities))
    for node in graph.nodes:
        if not node.is_stage:
            node.meta["executor"] = FRONTEND
    for edge in graph.edges:
        a, b = graph.node(edge.src).meta["executor"], graph.node(edge.dst).meta["executor"]
        if a != b and FRONTEND not in (a, b):
            reasons[a].append(f"split from {b}: {edge.name} {split_reason(graph, edge)}")
    graph.meta["executors"] = tuple(
        ExecutorGroup(name, devices, stages, tuple(reasons[name] or ["single stage"]), priorities)
        for name, devices, stages, priorities in executors
    )
    return graph
