"""An edge's `ChannelPlan`: its ends, item and schedule, its ring (from `plan_buffers`), its
adapter's code and its fused pointwise kernel."""

from __future__ import annotations

from omniflow import families
from omniflow.ir.graph import Edge, Graph
from omniflow.plan import ChannelPlan, PointwisePlan


def lower_channel(graph: Graph, edge: Edge) -> ChannelPlan:
    ring, item, kernel = edge.meta["channel"], edge.meta["item"], edge.meta.get("pointwise")
    schedule, carried = edge.meta["schedule"], edge.meta.get("carries_state", False)
    return ChannelPlan(
        edge.name,
        edge.src,
        edge.src_port,
        edge.dst,
        edge.dst_port,
        edge.type,
        ring.kind,
        graph.node(edge.src).meta["executor"],
        graph.node(edge.dst).meta["executor"],
        item.item.dtype,
        list(item.item.shape),
        item.max_steps,
        list(schedule) if schedule is not None else None,
        0 if carried else edge.context,
        carried,
        edge.adapter,
        adapter_impl(edge.adapter),
        [str(op) for op in edge.maps],
        pointwise_plan(kernel) if kernel else None,
        ring.slots,
        ring.slot_bytes,
        ring.ring_bytes,
        ring.credits,
        ring.device,
        edge.meta.get("plays_s"),
    )


def adapter_impl(name: str | None) -> str | None:
    """The code of a named adapter (None for none, or a user's function by dotted path)."""
    spec = families.adapters().get(name) if name else None
    return spec.impl if spec else None


def pointwise_plan(kernel) -> PointwisePlan:
    ops = [(name, list(args)) for name, args in kernel.ops]
    return PointwisePlan(kernel.kernel, ops, kernel.in_dtype, kernel.out_dtype, kernel.runs_in)
