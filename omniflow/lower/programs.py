"""One `Program` per executor, in the order the passes listed them, then the frontend's."""

from __future__ import annotations

from omniflow.ir.graph import Graph
from omniflow.plan import FRONTEND, ChannelPlan, Program, StagePlan


def programs(graph: Graph, stages: list[StagePlan], channels: list[ChannelPlan]) -> list[Program]:
    groups = [(x.name, x.devices, x.reasons) for x in graph.meta["executors"]]
    result = []
    for name, devices, reasons in [*groups, (FRONTEND, (), ())]:
        result.append(
            Program(
                name,
                list(devices),
                [s for s in stages if s.executor == name],
                [c for c in channels if c.dst_executor == name != c.src_executor],
                [c for c in channels if c.src_executor == name != c.dst_executor],
                [c for c in channels if c.src_executor == name == c.dst_executor],
                list(reasons),
            )
        )
    return result
