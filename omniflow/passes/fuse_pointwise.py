"""Pass: pointwise fusion. Each edge's `map(...)` chain becomes one fused kernel
(`omniflow.kernels.pointwise`: generated Triton on GPUs, torch elsewhere) that reads each
element once and writes it once, instead of one kernel and one temporary per op.

The kernel runs on the side of the hop where fewer bytes cross: in the producer's executor
when the chain shrinks items (pcm16 halves float32 audio), else in the consumer's.
"""

from __future__ import annotations

from omniflow.ir.graph import Graph
from omniflow.ir.types import TensorSpec
from omniflow.passes.common import Target
from omniflow.passes.facts import PointwiseKernel

READS = ("ports", "item", "executor")
WRITES = ("pointwise",)


def fuse_pointwise(graph: Graph, target: Target) -> Graph:
    graph = graph.copy()
    for edge in graph.edges:
        if not edge.maps:
            continue
        src = graph.node(edge.src)
        before: TensorSpec = src.meta["ports"].out[edge.src_port].step
        after: TensorSpec = edge.meta["item"].item
        shrinks = after.item_bytes() <= before.item_bytes()
        side = edge.src if shrinks else edge.dst
        edge.meta["pointwise"] = PointwiseKernel(
            "fused_" + "_".join(op.name for op in edge.maps),
            tuple((op.name, tuple(op.args)) for op in edge.maps),
            before.dtype,
            after.dtype,
            graph.node(side).meta["executor"],
        )
    return graph
