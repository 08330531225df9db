"""The lower phase: a Graph that has been through every pass -> its `Plan`.

Everything the runtime needs is decided here, once: each stage's load-time settings at their
compiled values, the per-request parameter template (`Param`, `StageSeed` for
a sampling stage that names no seed of its own), the limits a request's parameters must keep
to, and one `Program` per executor -- the frontend's too -- holding its stages and the
channels it reads, writes and keeps local. Nothing at run time reads the IR's kind table.
"""

from __future__ import annotations

import math

from omniflow import families
from omniflow.ir.graph import Graph
from omniflow.ir.kinds import KINDS, SEED, SEED_PARAM
from omniflow.ir.values import Auto, InputRef, Param, Ref, StageSeed, resolve
from omniflow.plan import (
    FRONTEND,
    PLAN_VERSION,
    ChannelPlan,
    FamilyCode,
    ParamLimit,
    Plan,
    PortPlan,
    Program,
    StagePlan,
)


def plain(value):
    """IR values as plan data: a parameter reference stays one, a name becomes its text."""
    if isinstance(value, Param):
        return Param(value.name)
    if isinstance(value, Ref):
        return value.dotted
    if isinstance(value, Auto):
        return "auto"
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


def lower(graph: Graph) -> Plan:
    """A Graph that has been through every pass -> its Plan."""
    stages = []
    for node in graph.topo_order():
        if not node.is_stage:
            continue
        cost = node.meta.get("cost")
        params = {k: plain(v) for k, v in node.params.items() if k not in ("model", "component")}
        if SEED_PARAM in KINDS[node.op].params and SEED_PARAM not in params:
            params[SEED_PARAM] = StageSeed(node.name)  # its own stream of the request's seed
        if "cfg_input" in node.meta:  # stages on a guidance path get the companion's value
            params["cfg"] = InputRef(node.meta["cfg_input"])
        stages.append(
            StagePlan(
                node.name,
                node.op,
                node.meta["executor"],
                node.meta["devices"],
                params,
                node.params.get("model", graph.model) if node.op != "python" else None,
                node.params.get("component"),
                node.meta["budget"],
                node.meta["need"],
                weight_bytes=cost.weight_bytes if cost else 0,
                kv_cache_bytes=cost.kv_cache_bytes if cost else 0,
                activation_bytes=cost.activation_bytes if cost else 0,
                flops_per_item=cost.flops_per_item if cost else 0.0,
                batch=node.meta.get("batch", 1),
                settings=load_settings(graph, node),
                placed=list(node.meta.get("placed", [])),
                family=family_code(node),
            )
        )
    channels = []
    for e in graph.edges:
        ch, item = e.meta["channel"], e.meta["item"]
        channels.append(
            ChannelPlan(
                e.name,
                e.src,
                e.src_port,
                e.dst,
                e.dst_port,
                e.type,
                ch["kind"],
                graph.node(e.src).meta["executor"],
                graph.node(e.dst).meta["executor"],
                item.dtype,
                list(item.shape),
                e.meta["max_steps"],
                e.meta["schedule"],
                e.context,
                e.adapter,
                adapter_impl(e.adapter),
                [str(op) for op in e.maps],
                e.meta.get("pointwise"),
                ch["slots"],
                ch["slot_bytes"],
                ch["ring_bytes"],
                ch.get("credits", 0),
                ch.get("device", ""),
            )
        )
    return Plan(
        version=PLAN_VERSION,
        pipeline=graph.name,
        model=graph.model,
        params={k: plain(v) for k, v in graph.params.items()},
        devices=[
            {"name": d, "used_bytes": u, "usable_bytes": c}
            | (
                {"node_id": graph.meta["node_ids"][d]}
                if d in graph.meta.get("node_ids", {})
                else {}
            )
            for d, (u, c) in graph.meta["device_usage"].items()
        ],
        programs=programs(graph, stages, channels),
        stages=stages,
        inputs=[
            PortPlan(n.name, n.params["type"], plain(n.params.get("default"))) for n in graph.inputs
        ],
        outputs=[
            PortPlan(
                n.name,
                graph.in_edges(n.name)[0].type,
                attrs={**n.params, **n.meta.get("attrs", {})},
            )
            for n in graph.outputs
        ],
        channels=channels,
        shm_bytes=graph.meta["shm_bytes"],
        device_ring_bytes=sum(c.ring_bytes for c in channels if c.device),
        limits=param_limits(graph),
        warnings=list(graph.meta.get("warnings", [])),
        pass_seconds=dict(graph.meta.get("pass_times", {})),
    )


def load_settings(graph: Graph, node) -> dict:
    """The stage's parameters at their compiled values (the request's seed excepted), and
    every other parameter of its kind at the kind's default, but for those whose default
    is the model's own (left out: the backend asks the checkpoint)."""
    settings = {
        key: plain(resolve(value, graph.params))
        for key, value in node.params.items()
        if key not in ("model", "component")
        and not (isinstance(value, Param) and value.name not in graph.params)
    }
    for key, spec in KINDS[node.op].params.items():
        if spec.default is not None and not spec.model_default:
            settings.setdefault(key, plain(spec.default))
    return settings


def family_code(node) -> FamilyCode | None:
    """What the stage's model family gives its backends (None: no family knows the model)."""
    config = node.meta.get("config")
    return families.stage_code(config.architectures, node.op) if config is not None else None


def adapter_impl(name: str | None) -> str | None:
    """The code of a named adapter (None for none, or a user's function by dotted path)."""
    spec = families.adapters().get(name) if name else None
    return spec.impl if spec else None


def param_limits(graph: Graph) -> dict[str, ParamLimit]:
    """Per parameter a request may set, the tightest bounds of the stage parameters it feeds;
    a `planned` one (memory and buffers were sized from it) is bounded by the compiled value."""
    bounds = {name: [-math.inf, math.inf, ""] for name in graph.params}
    bounds[SEED_PARAM] = [SEED.low, SEED.high, ""]
    for node in graph.stages:
        for key, value in node.params.items():
            spec = KINDS[node.op].params.get(key)
            if not isinstance(value, Param) or spec is None:
                continue
            bound = bounds[value.name]
            bound[0] = max(bound[0], spec.low)
            high = graph.params[value.name] if spec.planned else spec.high
            if high < bound[1]:
                why = f"stage '{node.name}' was compiled for {key}={high}" if spec.planned else ""
                bound[1:] = high, why
    return {
        name: ParamLimit(*(None if math.isinf(b) else b for b in (low, high)), why)
        for name, (low, high, why) in bounds.items()
    }


def programs(graph: Graph, stages: list[StagePlan], channels: list[ChannelPlan]) -> list[Program]:
    """One program per executor, in the order the passes listed them, then the frontend's."""
    executors = [(x["name"], x["devices"], x["reasons"]) for x in graph.meta["executors"]]
    result = []
    for name, devices, reasons in [*executors, (FRONTEND, [], [])]:
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
