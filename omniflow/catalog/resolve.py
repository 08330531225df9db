"""Where a stage's model comes from: a hub id, a local directory, or `tiny:NAME` — one of
the built-in tiny random-weight checkpoints of the real architectures, built on first use.

`use_tiny_models(graph)` swaps every model the examples name for its tiny counterpart, so a
real pipeline runs on any machine, through the same loading code as the real weights.

`model_path` is the one place production code reaches the checkpoint builders
(`omniflow.checkpoints`): it imports them lazily, to build a `tiny:` model on first use.
Nothing else outside tests, benchmarks and the `omniflow models` command imports them.
"""

from __future__ import annotations

from omniflow import families
from omniflow.errors import ModelConfigError
from omniflow.ir.graph import Graph

TINY_SCHEME = "tiny:"


def model_path(model: str, progress: bool = False) -> str:
    """What `from_pretrained` should load for `model` (building a tiny checkpoint if needed)."""
    if model.startswith(TINY_SCHEME):
        from omniflow.checkpoints.tiny import build_tiny

        return str(build_tiny(model.removeprefix(TINY_SCHEME), progress=progress))
    return model


def use_tiny_models(graph: Graph) -> Graph:
    """A copy of `graph` whose models are their tiny counterparts (unknown ones fail)."""

    def tiny(model: str) -> str:
        if model.startswith(TINY_SCHEME):
            return model
        name = families.tiny_counterpart(model)
        if name is None:
            known = ", ".join(families.counterparts())
            raise ModelConfigError(
                f"no tiny counterpart of '{model}'; tiny versions exist for {known}"
            )
        return TINY_SCHEME + name

    graph = graph.copy()
    if graph.model:
        graph.model = tiny(graph.model)
    for node in graph.stages:
        if isinstance(node.params.get("model"), str):
            node.params["model"] = tiny(node.params["model"])
    return graph
