"""The compiler's phases as named functions: parse -> build -> passes -> lower.

compile_file("x.omni", devices="2xH200")    # -> Plan
optimize_file("x.omni", devices="2xH200")   # -> Graph after the passes (str() shows the facts)
load_graph("x.omni")                        # -> Graph (parsed and built, no passes)
flags_that_fit("x.omni", "cpu")             # -> ["--devices 2xH200", "--tiny"]
"""

from __future__ import annotations

from pathlib import Path

from omniflow.catalog.resolve import model_path, use_tiny_models
from omniflow.devices import parse_devices
from omniflow.dsl.parser import parse, parse_file
from omniflow.errors import ModelConfigError, PassError, PlacementError
from omniflow.ir.from_ast import build
from omniflow.ir.graph import Graph
from omniflow.lower import lower
from omniflow.passes.pipeline import PassHook, Target, run_passes
from omniflow.plan import Plan

# The inventories tried for a graph that does not fit the machine at hand, smallest first:
# `compile` suggests the first that holds it.
SUGGESTED_INVENTORIES = ("1xH200", "2xH200", "4xH200", "8xH200")


def graph_from_source(text: str, path: str = "<string>") -> Graph:
    return build(parse(text, path))


def load_graph(path: str | Path) -> Graph:
    return build(parse_file(path))


def optimize(graph: Graph, devices: str = "cpu", on_pass: PassHook | None = None) -> Graph:
    return run_passes(graph, Target(tuple(parse_devices(devices))), on_pass=on_pass)


def compile_graph(graph: Graph, devices: str = "cpu", on_pass: PassHook | None = None) -> Plan:
    """`on_pass`: told of each pass as it finishes (run_passes)."""
    return lower(optimize(graph, devices, on_pass))


def compile_source(text: str, path: str = "<string>", devices: str = "cpu") -> Plan:
    return compile_graph(graph_from_source(text, path), devices)


def optimize_file(
    path: str | Path,
    devices: str = "cpu",
    tiny: bool = False,
    progress: bool = False,
    on_pass: PassHook | None = None,
    model: str | None = None,
) -> Graph:
    """The file's graph after the passes, what `lower` takes. `model`: serve it in place of
    the file's model line (`--model`). `tiny`: swap every model for its built-in tiny
    counterpart (same architecture), built on first use (`progress`: with a progress bar)."""
    graph = load_graph(path)
    if model:
        graph = with_model(graph, model)
    if tiny:
        graph = use_tiny_models(graph)
        for model in sorted({graph.model, *(s.params.get("model") for s in graph.stages)} - {None}):
            model_path(model, progress=progress)
    return optimize(graph, devices, on_pass)


def compile_file(path: str | Path, devices: str = "cpu", **options) -> Plan:
    """optimize_file's graph (`options`: its `tiny`, `progress`, `on_pass`, `model`) lowered
    to a plan."""
    return lower(optimize_file(path, devices, **options))


def flags_that_fit(path: str | Path, here: str) -> list[str]:
    """The `compile` flags under which a graph that does not fit `here` would: the smallest
    suggested inventory that holds it (`--devices 2xH200`), and `--tiny` when its tiny models
    fit `here`. Neither builds a checkpoint."""
    graph = load_graph(path)
    fits = next((spec for spec in SUGGESTED_INVENTORIES if _places(graph, spec)), None)
    flags = [f"--devices {fits}"] if fits else []
    try:
        tiny = use_tiny_models(graph)
    except ModelConfigError:  # a model with no tiny counterpart
        tiny = None
    if tiny is not None and _places(tiny, here):
        flags.append("--tiny")
    return flags


def _places(graph: Graph, devices: str) -> bool:
    """Whether the passes place `graph` on `devices` (any other failure is raised)."""
    try:
        optimize(graph, devices)
    except PassError as err:
        if isinstance(err.cause, PlacementError):
            return False
        raise
    return True


def with_model(graph: Graph, model: str) -> Graph:
    """A copy of `graph` that serves `model` in place of its model line (stages that name a
    model of their own keep it). A model of another family than the line's is refused,
    naming the example graph that serves it."""
    from omniflow.supported import family_of, serving_graph

    if not graph.model:
        raise ModelConfigError(f"pipeline '{graph.name}' has no model line for --model to replace")
    ours, theirs = family_of(graph.model), family_of(model)
    if ours is not None and theirs is not None and ours is not theirs:
        serving, _ = serving_graph(model)
        where = f"; graphs/{serving}.omni serves it" if serving else ""
        raise ModelConfigError(
            f"--model {model}: pipeline '{graph.name}' serves {ours.name} models, and "
            f"{model} is a {theirs.name} model{where}"
        )
    graph = graph.copy()
    graph.model = model
    return graph
