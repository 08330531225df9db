"""Pass: memory and compute estimates per stage, from its model config.

`meta["cost"]` is a `CostFacts`: the StageCost at the stage's effective batch (doubled on
the path of a classifier-free-guidance companion), and the bytes its budget must cover:
weights + KV cache + activations, or the explicit `memory=` the program gives (a python
stage has nothing to estimate: its `memory=`, else nothing). An edit
pipeline's stages pay for the input image too: its tokens in the text encoder's and the
DiT's sequences, and the VAE the DiT stage encodes it with.
"""

from __future__ import annotations

import math

from omniflow.catalog.costs import StageCost, estimate_cost, with_encoder
from omniflow.devices import parse_size
from omniflow.ir.graph import Graph, Node
from omniflow.passes.common import Target, cfg_path, condition_image_tokens, stage_dtype
from omniflow.passes.facts import CostFacts

READS = ("model", "item")
WRITES = ("cost",)


def _sequence_length(graph: Graph, node: Node) -> int:
    """Tokens one request keeps live in this stage: its KV length, image tokens or frames;
    a VAE's latent positions at once."""
    if node.op == "diffusion":
        cfg = node.meta["model"].config
        image = cfg.image_tokens(
            graph.param_value(node, "height"),
            graph.param_value(node, "width"),
            graph.param_value(node, "frames"),
        )
        return image + condition_image_tokens(graph, node)
    if node.op == "vae":  # latent positions per image or video: the item its producer sends
        edge = next(e for e in graph.in_edges(node.name) if e.dst_port == "latents")
        _, *positions = edge.meta["item"].item.shape
        cfg = node.meta["model"].config
        at_once = cfg.config.get("latent_frames_per_decode")
        if at_once and len(positions) == 3:
            # A video VAE decoding a few latent frames at a time holds those frames' outputs
            # (each up to temporal-factor video frames), not the whole video's.
            positions[0] = min(positions[0], at_once) * cfg.vae_temporal_factor
        return math.prod(positions)
    return graph.param_value(node, "max_len") + condition_image_tokens(graph, node)


def _cache_length(graph: Graph, node: Node) -> int:
    """Positions one request's KV cache holds in an `ar` stage (0 elsewhere): its prompt (up
    to max_len, and the positions its family adds to a prompt built from another stage's)
    and the max_tokens it generates after it (the plan carries it to the backend, whose
    static cache is that many columns a slot: transformers_ar.cache_columns)."""
    if node.op != "ar":
        return 0
    added = node.meta["model"].config.added_positions
    return _sequence_length(graph, node) + added + graph.param_value(node, "max_tokens")


def _text_tokens(graph: Graph, node: Node) -> int | None:
    """Text tokens a DiT attends to beside the image: as many as its conditioning edge
    carries, unless its pipeline caps them (`max_text_len`; None leaves that to the
    estimator)."""
    if node.op != "diffusion" or "max_text_len" in node.meta["model"].config.config:
        return None
    cond = next((e for e in graph.in_edges(node.name) if e.dst_port == "cond"), None)
    return None if cond is None else cond.meta["item"].item.shape[0] - 1  # less the header row


def _image_encoder_cost(graph: Graph, node: Node) -> StageCost:
    """The VAE encode of a DiT's input image: one image per forward, at the most latent
    positions its pipeline conditions on (each DiT token is patch x patch of them), or for
    a video DiT the conditioning video's."""
    dit = node.meta["model"].config
    # An image conditioned on by channels or as the first frame (Wan2.2's) adds no tokens:
    # the VAE encodes a conditioning video of the output's size.
    tokens = condition_image_tokens(graph, node) or _sequence_length(graph, node)
    positions = tokens * dit.patch_size**2
    return estimate_cost(
        node.meta["model"].image_encoder,
        max_batch=1,
        max_len=positions,
        dtype=stage_dtype(graph, node),
    )


def _expert_cost(graph: Graph, node: Node, expert, batch: int) -> StageCost:
    """Another expert of a two-expert DiT (Wan2.2-A14B's low-noise transformer): its weights
    are loaded beside the first's; a step runs one expert or the other for each request."""
    return estimate_cost(
        expert,
        max_batch=batch,
        max_len=_sequence_length(graph, node),
        dtype=stage_dtype(graph, node),
        context_len=_text_tokens(graph, node),
    )


def estimate_costs(graph: Graph, target: Target) -> Graph:
    graph = graph.copy()
    doubled = cfg_path(graph)
    for node in graph.stages:
        explicit = graph.param_value(node, "memory")
        if node.op == "python":  # nothing to estimate: what it says, else nothing
            node.meta["cost"] = CostFacts(None, parse_size(explicit) if explicit else 0)
            continue
        batch = graph.param_value(node, "max_batch") * (2 if node.name in doubled else 1)
        cache = _cache_length(graph, node)
        cost = estimate_cost(
            node.meta["model"].config,
            max_batch=batch,
            max_len=_sequence_length(graph, node),
            dtype=stage_dtype(graph, node),
            prefill_tokens=graph.param_value(node, "prefill_tokens") if node.op == "ar" else None,
            context_len=_text_tokens(graph, node),
            cache_len=cache or None,
        )
        if node.meta["model"].image_encoder is not None:
            cost = with_encoder(cost, _image_encoder_cost(graph, node))
        for expert in node.meta["model"].experts:  # loaded beside it, run at other steps
            cost = with_encoder(cost, _expert_cost(graph, node, expert, batch))
        need = parse_size(explicit) if explicit else cost.total_bytes
        node.meta["cost"] = CostFacts(cost, need, batch, doubled.get(node.name), cache)
    return graph
