"""The numbers a request may give each pipeline parameter (`ParamLimit`s)."""

from __future__ import annotations

import math

from omniflow.ir.graph import Graph
from omniflow.ir.kinds import KINDS, SEED, SEED_PARAM
from omniflow.ir.values import Param
from omniflow.plan import ParamLimit


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
