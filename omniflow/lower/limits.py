"""The numbers a request may give each pipeline parameter (`ParamLimit`s)."""

from __future__ import annotations

import math

from omniflow import families
from omniflow.ir.graph import Graph
from omniflow.ir.kinds import KINDS, SEED, SEED_PARAM
from omniflow.ir.values import Param
from omniflow.plan import ParamLimit


def param_limits(graph: Graph) -> dict[str, ParamLimit]:
    """Per parameter a request may set, the tightest bounds of the stage parameters it feeds
    (a `planned` one, which memory and buffers were sized from, is bounded by the compiled
    value), and the sampling knobs whose domains it must be in."""
    bounds = {name: [-math.inf, math.inf, ""] for name in graph.params}
    bounds[SEED_PARAM] = [SEED.low, SEED.high, ""]
    knobs: dict[str, set[str]] = {name: set() for name in bounds}
    for node in graph.stages:
        for key, value in node.params.items():
            spec = KINDS[node.op].params.get(key) or families.extra_params(node.op).get(key)
            if not isinstance(value, Param) or spec is None:
                continue
            if spec.knob:
                knobs[value.name].add(spec.knob)
            bound = bounds[value.name]
            bound[0] = max(bound[0], spec.low)
            high = graph.params[value.name] if spec.planned else spec.high
            if high < bound[1]:
                why = f"stage '{node.name}' was compiled for {key}={high}" if spec.planned else ""
                bound[1:] = high, why
    return {
        name: ParamLimit(
            *(None if math.isinf(b) else b for b in (low, high)), why, sorted(knobs[name])
        )
        for name, (low, high, why) in bounds.items()
    }
