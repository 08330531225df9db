"""Pass: stage fusion. Stages on one device joined by per-token streams run in one executor
process, so each hand-off is an in-process reference instead of an IPC round trip (which
costs ~0.1-0.8 ms, paid per token on such a stream). Every other edge stays a process
boundary, so the stages run in parallel. `meta["executor"]` names each node's executor
(inputs and outputs live in the `frontend`), and `graph.meta["executors"]` lists them
(`ExecutorGroup`) with the reason each was formed and why its neighbours were kept apart.
"""

from __future__ import annotations

from omniflow.ir.graph import Edge, Graph
from omniflow.passes.common import PER_TOKEN_CHUNK, DisjointSets, Target
from omniflow.passes.facts import ExecutorGroup
from omniflow.plan import FRONTEND

READS = ("placement",)
WRITES = ("executor", "executors")


def _devices(graph: Graph, name: str) -> tuple[str, ...]:
    return graph.node(name).meta["placement"].devices


def _fusable(graph: Graph, edge: Edge) -> bool:
    src, dst = graph.node(edge.src), graph.node(edge.dst)
    return (
        src.is_stage
        and dst.is_stage
        and isinstance(edge.chunk, int)
        and edge.chunk <= PER_TOKEN_CHUNK
        and _devices(graph, src.name) == _devices(graph, dst.name)
    )


def split_reason(graph: Graph, edge: Edge) -> str:
    ends = _devices(graph, edge.src), _devices(graph, edge.dst)
    if ends[0] != ends[1]:
        return f"on different devices ({'/'.join(ends[0])} vs {'/'.join(ends[1])})"
    if edge.chunk is None:
        return "whole-output edge: one hand-off per request"
    return (
        f"chunked stream (chunk={edge.chunk}) amortizes the hop; separate processes run in parallel"
    )


def fuse_stages(graph: Graph, target: Target) -> Graph:
    graph = graph.copy()
    groups = DisjointSets(n.name for n in graph.stages)
    reasons: dict[str, list[str]] = {}
    for edge in graph.edges:
        if _fusable(graph, edge):
            groups.union(edge.src, edge.dst)
    executors = []
    for names in groups.sets(n.name for n in graph.topo_order() if n.is_stage):
        name = "+".join(names)
        for n in names:
            graph.node(n).meta["executor"] = name
        inside = [e for e in graph.edges if e.src in names and e.dst in names]
        reasons[name] = [f"fused: {e.name} streams chunk={e.chunk} on one device" for e in inside]
        executors.append((name, _devices(graph, names[0]), tuple(names)))
    for node in graph.nodes:
        if not node.is_stage:
            node.meta["executor"] = FRONTEND
    for edge in graph.edges:
        a, b = graph.node(edge.src).meta["executor"], graph.node(edge.dst).meta["executor"]
        if a != b and FRONTEND not in (a, b):
            reasons[a].append(f"split from {b}: {edge.name} {split_reason(graph, edge)}")
    graph.meta["executors"] = tuple(
        ExecutorGroup(name, devices, stages, tuple(reasons[name] or ["single stage"]))
        for name, devices, stages in executors
    )
    return graph
