"""Pass: buffer planning. Every edge that crosses executors (the frontend included) gets a
pre-allocated shared-memory ring: `meta["channel"]` = kind "shm", slots, slot bytes, ring
bytes. A slot holds the largest message the edge can carry (the largest chunk of the
schedule, or the whole output); there are `credits` slots per request the consumer may
batch, so a producer can run `credits` chunks ahead per request before it blocks. Edges
inside one executor pass references: kind "local", no bytes.
"""

from __future__ import annotations

from omniflow.devices import GiB
from omniflow.ir.graph import Edge, Graph
from omniflow.passes.common import Target

DEFAULT_CREDITS = 2
SLOT_ALIGN = 64
# Rings larger than this get fewer slots (never under one request's credits), with a warning.
RING_CAP = 1 * GiB


def _align(n: int) -> int:
    return -(-n // SLOT_ALIGN) * SLOT_ALIGN


def _concurrency(graph: Graph, edge: Edge) -> int:
    """Requests that may hold slots at once: the consumer's batch (the producer's if a client reads)."""
    for name in (edge.dst, edge.src):
        node = graph.node(name)
        if node.is_stage:
            return graph.param_value(node, "max_batch") * graph.param_value(node, "replicas")
    return 1


def plan_buffers(graph: Graph, target: Target) -> Graph:
    graph = graph.copy()
    warnings = graph.meta["warnings"] = list(graph.meta.get("warnings", []))
    total = 0
    for edge in graph.edges:
        src, dst = graph.node(edge.src), graph.node(edge.dst)
        if src.meta["executor"] == dst.meta["executor"]:
            edge.meta["channel"] = {"kind": "local", "slots": 0, "slot_bytes": 0, "ring_bytes": 0}
            continue
        steps = max(edge.meta["schedule"]) if edge.stream else edge.meta["max_steps"]
        slot_bytes = _align(edge.meta["item"].item_bytes() * steps)
        credits = edge.credits or DEFAULT_CREDITS
        slots = credits * _concurrency(graph, edge)
        if slots * slot_bytes > RING_CAP and slots > credits:
            fewer = max(credits, RING_CAP // slot_bytes)
            warnings.append(
                f"{edge.name}: ring capped at {fewer} slots of {slot_bytes} bytes (wanted {slots})"
            )
            slots = fewer
        edge.meta["channel"] = {
            "kind": "shm",
            "slots": slots,
            "slot_bytes": slot_bytes,
            "ring_bytes": slots * slot_bytes,
            "credits": credits,
        }
        total += slots * slot_bytes
    graph.meta["shm_bytes"] = total
    return graph
