"""The `Plan`: what the compiler hands the runtime, and `lower`, which makes one from a
fully annotated Graph. A plan is plain data, versioned and JSON-serializable; pipeline
parameter references stay symbolic (`{"$param": name}`) so each request can override them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import msgspec

from omniflow.errors import OmniflowError
from omniflow.ir.graph import Graph
from omniflow.ir.kinds import KINDS, SEED, SEED_PARAM
from omniflow.ir.values import Auto, Param, Ref, resolve

PLAN_VERSION = 1


@dataclass
class StagePlan:
    """One stage. `params`: the per-request template (`{"$param": p}` and `{"$seed": stage}`
    resolve at admission); `settings`: what its backend loads with, every parameter the
    program gives resolved to its compiled value, and its `max_batch`."""

    name: str
    kind: str
    executor: str
    devices: list[str]
    params: dict
    model: str | None
    component: str | None
    budget_bytes: int
    need_bytes: int
    weight_bytes: int = 0
    kv_cache_bytes: int = 0
    activation_bytes: int = 0
    flops_per_item: float = 0.0
    batch: int = 1
    settings: dict = field(default_factory=dict)


@dataclass
class ExecutorPlan:
    name: str
    devices: list[str]
    stages: list[str]
    reasons: list[str]


@dataclass
class ChannelPlan:
    name: str
    src: str
    src_port: str
    dst: str
    dst_port: str
    type: str
    kind: str  # "local" (same executor: references) or "shm" (a ring)
    src_executor: str
    dst_executor: str
    item_dtype: str
    item_shape: list[int]
    max_steps: int
    schedule: list[int] | None  # None: the whole output in one message
    context: int = 0
    adapter: str | None = None
    maps: list[str] = field(default_factory=list)
    pointwise: dict | None = None
    slots: int = 0
    slot_bytes: int = 0
    ring_bytes: int = 0
    credits: int = 0


@dataclass
class PortPlan:
    name: str
    type: str
    default: object = None
    attrs: dict = field(default_factory=dict)


@dataclass
class ParamLimit:
    """The numbers a request may give a pipeline parameter: `low <= value <= high` (None:
    unbounded); `why` says where `high` comes from when the plan was compiled for it."""

    low: int | float | None
    high: int | float | None
    why: str = ""


@dataclass
class Plan:
    version: int
    pipeline: str
    model: str | None
    params: dict
    devices: list[dict]
    executors: list[ExecutorPlan]
    stages: list[StagePlan]
    inputs: list[PortPlan]
    outputs: list[PortPlan]
    channels: list[ChannelPlan]
    shm_bytes: int = 0
    limits: dict[str, ParamLimit] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    pass_seconds: dict = field(default_factory=dict)

    def to_json(self, indent: int = 2) -> str:
        return msgspec.json.format(msgspec.json.encode(self).decode(), indent=indent)

    @classmethod
    def from_json(cls, text: str | bytes) -> Plan:
        try:
            plan = msgspec.json.decode(text, type=cls)
        except msgspec.DecodeError as err:
            raise OmniflowError(f"not a valid plan: {err}") from err
        if plan.version != PLAN_VERSION:
            raise OmniflowError(
                f"plan version {plan.version} is not supported (this omniflow reads {PLAN_VERSION})"
            )
        return plan

    def stage(self, name: str) -> StagePlan:
        return next(s for s in self.stages if s.name == name)


def plain(value):
    """IR values as JSON data: parameters and names become tagged objects."""
    if isinstance(value, Param):
        return {"$param": value.name}
    if isinstance(value, Ref):
        return {"$ref": value.dotted}
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
            params[SEED_PARAM] = {"$seed": node.name}  # its own stream of the request's seed
        if "cfg_input" in node.meta:  # stages on a guidance path get the companion's value
            params["cfg"] = {"$ref": node.meta["cfg_input"]}
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
                [str(op) for op in e.maps],
                e.meta.get("pointwise"),
                ch["slots"],
                ch["slot_bytes"],
                ch["ring_bytes"],
                ch.get("credits", 0),
            )
        )
    return Plan(
        version=PLAN_VERSION,
        pipeline=graph.name,
        model=graph.model,
        params={k: plain(v) for k, v in graph.params.items()},
        devices=[
            {"name": d, "used_bytes": u, "usable_bytes": c}
            for d, (u, c) in graph.meta["device_usage"].items()
        ],
        executors=[
            ExecutorPlan(x["name"], x["devices"], x["stages"], x["reasons"])
            for x in graph.meta["executors"]
        ],
        stages=stages,
        inputs=[
            PortPlan(n.name, n.params["type"], plain(n.params.get("default"))) for n in graph.inputs
        ],
        outputs=[
            PortPlan(n.name, graph.in_edges(n.name)[0].type, attrs=dict(n.params))
            for n in graph.outputs
        ],
        channels=channels,
        shm_bytes=graph.meta["shm_bytes"],
        limits=param_limits(graph),
        warnings=list(graph.meta.get("warnings", [])),
        pass_seconds=dict(graph.meta.get("pass_times", {})),
    )


def load_settings(graph: Graph, node) -> dict:
    """The stage's parameters at their compiled values (the request's seed excepted)."""
    settings = {
        key: plain(resolve(value, graph.params))
        for key, value in node.params.items()
        if key not in ("model", "component")
        and not (isinstance(value, Param) and value.name not in graph.params)
    }
    settings.setdefault("max_batch", KINDS[node.op].params["max_batch"].default)
    return settings


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


def resolve_params(
    params: dict, defaults: dict, overrides: dict | None = None, inputs: dict | None = None
) -> dict:
    """A stage's parameters for one request: `{"$param": name}` replaced by the request's
    override of that pipeline parameter (or its default), `{"$ref": input}` by the value of
    that input of the request (a guidance companion)."""
    values = {**defaults, **(overrides or {})}
    inputs = inputs or {}

    def value(v):
        if isinstance(v, dict) and "$param" in v:
            return values[v["$param"]]
        if isinstance(v, dict) and v.get("$ref") in inputs:
            return inputs[v["$ref"]]
        if isinstance(v, list):
            return [value(x) for x in v]
        return v

    return {k: value(v) for k, v in params.items()}
