"""Pass: attach each model stage's component configuration (from a local path, the HF cache,
or the built-in catalog) as `meta["model"]`, a `ModelFacts`; a denoiser given an input image
also gets its pipeline's VAE, which encodes that image in the stage.

A stage may take parameters and input ports its model's family adds to its kind
(`Family.stage_params`, `stage_inputs`); build accepted those of any family, and here, with
the model known, one its own family does not add is an error at the stage."""

from __future__ import annotations

from omniflow import families
from omniflow.catalog.components import ComponentConfig, load_component_config
from omniflow.errors import GraphError, ModelConfigError, UnknownComponent
from omniflow.ir.graph import Graph, Node
from omniflow.ir.kinds import KINDS
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
        try:
            config = load_component_config(model, node.params.get("component"))
            encodes = node.op == "diffusion" and takes_image(graph, node)
            encoder = load_component_config(model, "vae") if encodes else None
            experts = tuple(
                load_component_config(model, c) for c in config.config.get("experts", ())
            )
        except ModelConfigError as err:
            raise GraphError(str(err), _span_of(graph, node, err)) from err
        _check_family_additions(graph, node, config)
        node.meta["model"] = ModelFacts(config, encoder, experts)
    return graph


def _span_of(graph: Graph, node: Node, err: ModelConfigError):
    """Where in the `.omni` file what `err` is about is given: the stage's `component`, or
    its model (the stage's `model=`, else the pipeline's `model` line); else the stage."""
    if isinstance(err, UnknownComponent) and "component" in node.arg_spans:
        return node.arg_spans["component"]
    if "model" in node.params:
        return node.arg_spans.get("model", node.span)
    return graph.model_span or node.span


def _check_family_additions(graph: Graph, node: Node, config: ComponentConfig) -> None:
    kind = KINDS[node.op]
    own = families.knowing(config.architectures)
    params = {n for f in own for n in f.stage_params.get(node.op, {})}
    ports = {p for f in own for p in f.stage_inputs.get(node.op, {})}
    outs = {p for f in own for p in f.stage_outputs.get(node.op, {})}
    added = [(f"parameter '{k}'", k in params) for k in node.params if k not in kind.params]
    added += [
        (f"input port '{e.dst_port}'", e.dst_port in ports)
        for e in graph.in_edges(node.name)
        if e.dst_port not in kind.inputs
    ]
    added += [
        (f"output port '{e.src_port}'", e.src_port in outs)
        for e in graph.out_edges(node.name)
        if e.src_port not in kind.outputs
    ]
    for what, ok in added:
        if not ok:
            family = own[0].name if own else "no model family"
            raise GraphError(
                f"stage '{node.name}': {what} is not one of {node.op} stages'; a model family "
                f"adds it, and {config.model} ({family}) does not",
                node.span,
            )
