"""Run the passes up to (and including) a named one on an example pipeline."""

from pathlib import Path

from omniflow.compiler import graph_from_source, load_graph
from omniflow.devices import parse_devices
from omniflow.passes.pipeline import Target, default_passes, run_passes

GRAPHS = Path(__file__).parents[2] / "graphs"


def run_until(name: str, source: str, devices: str = "2xH200"):
    """`source` is an example's stem ("omni_chat") or .omni text."""
    graph = graph_from_source(source) if "{" in source else load_graph(GRAPHS / f"{source}.omni")
    passes = default_passes()
    upto = [p.__name__ for p in passes].index(name) + 1
    return run_passes(graph, Target(tuple(parse_devices(devices))), passes[:upto])
