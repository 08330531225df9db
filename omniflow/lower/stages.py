"""A stage's `StagePlan`: its per-request template, its load-time settings (every parameter
of its kind at its compiled value), its placement and costs, and its model family's code."""

from __future__ import annotations

from omniflow import families
from omniflow.ir.graph import Graph, Node
from omniflow.ir.kinds import KINDS, SEED_PARAM
from omniflow.ir.values import InputRef, Param, StageSeed, resolve
from omniflow.lower.values import plain
from omniflow.plan import FamilyCode, StagePlan

# What a stage's params name outside its template: its model, read into the plan's fields.
_MODEL_KEYS = ("model", "component")


def lower_stage(graph: Graph, node: Node) -> StagePlan:
    facts, placement = node.meta["cost"], node.meta["placement"]
    cost = facts.cost
    return StagePlan(
        node.name,
        node.op,
        node.meta["executor"],
        list(placement.devices),
        request_template(node, facts.cfg_input),
        node.params.get("model", graph.model) if node.op != "python" else None,
        node.params.get("component"),
        placement.budget,
        placement.need,
        weight_bytes=cost.weight_bytes if cost else 0,
        kv_cache_bytes=cost.kv_cache_bytes if cost else 0,
        activation_bytes=cost.activation_bytes if cost else 0,
        flops_per_item=cost.flops_per_item if cost else 0.0,
        batch=facts.batch,
        settings=load_settings(graph, node),
        cache_positions=facts.cache_positions,
        placed=list(placement.placed),
        family=family_code(node),
    )


def request_template(node: Node, cfg_input: str | None) -> dict:
    """What a request's parameters fill in: the program's values, pipeline parameters left
    symbolic; a sampling stage that names no seed its own stream of the request's; a stage
    on a guidance path the companion input's value."""
    params = {k: plain(v) for k, v in node.params.items() if k not in _MODEL_KEYS}
    if SEED_PARAM in KINDS[node.op].params and SEED_PARAM not in params:
        params[SEED_PARAM] = StageSeed(node.name)
    if cfg_input is not None:
        params["cfg"] = InputRef(cfg_input)
    return params


def load_settings(graph: Graph, node: Node) -> dict:
    """The stage's parameters at their compiled values (the request's seed excepted), and
    every other parameter of its kind at the kind's default, but for those whose default
    is the model's own (left out: the backend asks the checkpoint)."""
    settings = {
        key: plain(resolve(value, graph.params))
        for key, value in node.params.items()
        if key not in _MODEL_KEYS
        and not (isinstance(value, Param) and value.name not in graph.params)
    }
    for key, spec in {**family_params(node), **KINDS[node.op].params}.items():
        if spec.default is not None and not spec.model_default:
            settings.setdefault(key, plain(spec.default))
    return settings


def family_params(node: Node) -> dict:
    """The parameters the stage's model family adds to its kind."""
    model = node.meta.get("model")
    known = families.knowing(model.config.architectures) if model else []
    return {k: spec for f in known for k, spec in f.stage_params.get(node.op, {}).items()}


def family_code(node: Node) -> FamilyCode | None:
    """What the stage's model family gives its backends (None: no family knows the model)."""
    model = node.meta.get("model")
    return families.stage_code(model.config.architectures, node.op) if model else None
