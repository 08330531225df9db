"""Pass: attach each model stage's component configuration (from a local path, the HF cache,
or the built-in catalog) as `meta["model"]`, a `ModelFacts`; a denoiser given an input image
also gets its pipeline's VAE, which encodes that image in the stage."""

from __future__ import annotations

from omniflow.catalog.components import load_component_config
from omniflow.ir.graph import Graph
from omniflow.passes.common import Target, takes_image
from omniflow.passes.facts import ModelFacts

READS: tuple[str, ...] = ()
WRITES = ("model",)


def resolve_models(graph: Graph, target: Target) -> Graph:
    graph = graph.copy()
    for node in graph.stages:
        if node.op == "python":
            continue
        model = node.params.get("model", graph.model)
        config = load_component_config(model, node.params.get("component"))
        encodes = node.op == "diffusion" and takes_image(graph, node)
        encoder = load_component_config(model, "vae") if encodes else None
        node.meta["model"] = ModelFacts(config, encoder)
    return graph
