"""One `Program` per executor, in the order the passes listed them, then the frontend's."""

from __future__ import annotations

from omniflow.ir.graph import Graph
from omniflow.passes.facts import ExecutorGroup
from omniflow.plan import FRONTEND, ChannelPlan, Program, StagePlan


def programs(graph: Graph, stages: list[StagePlan], channels: list[ChannelPlan]) -> list[Program]:
    result = []
    for group in [*graph.meta["executors"], ExecutorGroup(FRONTEND, (), ())]:
        name = group.name
        result.append(
            Program(
                name,
                list(group.devices),
                [s for s in stages if s.executor == name],
                [c for c in channels if c.dst_executor == name != c.src_executor],
                [c for c in channels if c.src_executor == name != c.dst_executor],
                [c for c in channels if c.src_executor == name == c.dst_executor],
                list(group.reasons),
                # Empty off GPUs: there the program runs its stages on no stream of their own.
                dict(zip(group.stages, group.priorities, strict=False)),
            )
        )
    return result
