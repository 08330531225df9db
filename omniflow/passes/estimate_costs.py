"""Pass: memory and compute estimates per stage, from its model config.

`meta["cost"]` is the StageCost of one replica at its effective batch (doubled on the path
of a classifier-free-guidance companion), `meta["need"]` the bytes its budget must cover:
weights + KV cache + activations, or the explicit `memory=` the program gives.
"""

from __future__ import annotations

from omniflow.devices import parse_size
from omniflow.ir.graph import Graph, Node
from omniflow.models.costs import estimate_cost
from omniflow.passes.common import Target, cfg_path, stage_dtype


def _sequence_length(graph: Graph, node: Node) -> int:
    """Tokens one request keeps live in this stage: its KV length, image tokens or frames."""
    if node.op == "diffusion":
        cfg = node.meta["config"]
        patch = cfg.vae_scale_factor * cfg.patch_size
        return (graph.param_value(node, "height") // patch) * (
            graph.param_value(node, "width") // patch
        )
    if node.op == "vae":  # latent positions per image: the item its producer sends
        latents = next(e for e in graph.in_edges(node.name) if e.dst_port == "latents").meta["item"]
        return latents.shape[-1] * latents.shape[-2]
    return graph.param_value(node, "max_len")


def estimate_costs(graph: Graph, target: Target) -> Graph:
    graph = graph.copy()
    doubled = cfg_path(graph)
    for node in graph.stages:
        if node.op == "python":
            node.meta["need"] = 0
            continue
        batch = graph.param_value(node, "max_batch") * (2 if node.name in doubled else 1)
        if node.name in doubled:
            node.meta["cfg_input"] = doubled[node.name]
        cost = estimate_cost(
            node.meta["config"],
            max_batch=batch,
            max_len=_sequence_length(graph, node),
            dtype=stage_dtype(graph, node),
        )
        node.meta["batch"] = batch
        node.meta["cost"] = cost
        explicit = graph.param_value(node, "memory")
        node.meta["need"] = parse_size(explicit) if explicit else cost.total_bytes
    return graph
