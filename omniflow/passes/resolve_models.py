"""Pass: attach each model stage's component configuration (from a local path, the HF cache,
or the built-in catalog) as `meta["config"]`; a denoiser given an input image also gets its
pipeline's VAE, which encodes that image in the stage, as `meta["image_encoder"]`."""

from __future__ import annotations

from omniflow.catalog.components import load_component_config
from omniflow.ir.graph import Graph
from omniflow.passes.common import Target, takes_image


def resolve_models(graph: Graph, target: Target) -> Graph:
    graph = graph.copy()
    for node in graph.stages:
        if node.op == "python":
            continue
        model = node.params.get("model", graph.model)
        node.meta["config"] = load_component_config(model, node.params.get("component"))
        if node.op == "diffusion" and takes_image(graph, node):
            node.meta["image_encoder"] = load_component_config(model, "vae")
    return graph
