"""The lower phase: a Graph that has been through every pass -> its `Plan`.

Everything the runtime needs is decided here, once, from the passes' typed facts
(`omniflow.passes.facts`): each stage's load-time settings at their compiled values and its
model family's code (`stages.py`), each channel's ring and kernel (`channels.py`), the
per-request parameter template and the limits a request's parameters must keep to
(`limits.py`), and one `Program` per executor -- the frontend's too -- holding its stages
and the channels it reads, writes and keeps local (`programs.py`). Nothing at run time reads
the IR's kind table or a model family's descriptor.
"""

from __future__ import annotations

from omniflow.ir.graph import Graph
from omniflow.lower.channels import lower_channel
from omniflow.lower.limits import param_limits
from omniflow.lower.programs import programs
from omniflow.lower.stages import lower_stage
from omniflow.lower.values import plain
from omniflow.plan import PLAN_VERSION, DevicePlan, Plan, PortPlan

__all__ = ["lower", "plain"]


def lower(graph: Graph) -> Plan:
    """A Graph that has been through every pass -> its Plan."""
    stages = [lower_stage(graph, node) for node in graph.topo_order() if node.is_stage]
    channels = [lower_channel(graph, edge) for edge in graph.edges]
    return Plan(
        version=PLAN_VERSION,
        pipeline=graph.name,
        model=graph.model,
        params={k: plain(v) for k, v in graph.params.items()},
        devices=[
            DevicePlan(d.name, d.used, d.usable, d.node_id, d.contexts, d.context_bytes, d.total)
            for d in graph.meta["devices"]
        ],
        programs=programs(graph, stages, channels),
        stages=stages,
        inputs=[
            PortPlan(
                n.name,
                n.params["type"],
                plain(n.params.get("default")),
                optional=bool(n.params.get("optional")),
            )
            for n in graph.inputs
        ],
        outputs=[
            PortPlan(
                n.name, graph.in_edges(n.name)[0].type, attrs={**n.params, **n.meta["attrs"].attrs}
            )
            for n in graph.outputs
        ],
        channels=channels,
        shm_bytes=graph.meta["shm_bytes"],
        device_ring_bytes=sum(c.ring_bytes for c in channels if c.device),
        limits=param_limits(graph),
        warnings=list(graph.meta.get("warnings", ())),
        pass_seconds=dict(graph.meta.get("pass_times", {})),
    )
