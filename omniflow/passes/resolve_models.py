"""Pass: attach each model stage's component configuration (from a local path, the HF cache,
or the built-in catalog) as `meta["config"]`."""

from __future__ import annotations

from omniflow.ir.graph import Graph
from omniflow.models.catalog import load_component_config
from omniflow.passes.common import Target


def resolve_models(graph: Graph, target: Target) -> Graph:
    graph = graph.copy()
    for node in graph.stages:
        if node.op == "python":
            continue
        model = node.params.get("model", graph.model)
        node.meta["config"] = load_component_config(model, node.params.get("component"))
    return graph
