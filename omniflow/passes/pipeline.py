"""The ordered pass pipeline: runs each pass, times it, lints after it, names it in errors."""

from __future__ import annotations

import time
from collections.abc import Callable

from omniflow.errors import OmniflowError, PassError
from omniflow.ir.graph import Graph
from omniflow.passes.common import Target
from omniflow.passes.estimate_costs import estimate_costs
from omniflow.passes.fuse_pointwise import fuse_pointwise
from omniflow.passes.fuse_stages import fuse_stages
from omniflow.passes.infer_types import infer_types
from omniflow.passes.place import place
from omniflow.passes.plan_buffers import plan_buffers
from omniflow.passes.resolve_models import resolve_models
from omniflow.passes.size_chunks import size_chunks

__all__ = ["Pass", "PassHook", "Target", "default_passes", "run_passes"]

Pass = Callable[[Graph, Target], Graph]
# Told of every pass that ran: its name, the graph it was given, the graph it returned and its
# seconds (`omniflow compile --viz` draws the graph after each pass from these).
PassHook = Callable[[str, Graph, Graph, float], None]


def default_passes() -> list[Pass]:
    return [
        resolve_models,
        infer_types,
        estimate_costs,
        place,
        fuse_stages,
        fuse_pointwise,
        size_chunks,
        plan_buffers,
    ]


def run_passes(
    graph: Graph,
    target: Target,
    passes: list[Pass] | None = None,
    on_pass: PassHook | None = None,
) -> Graph:
    """Run `passes` in order; each gets the previous result. Records per-pass seconds;
    `on_pass` hears of each pass as it finishes."""
    times: dict[str, float] = {}
    for p in passes if passes is not None else default_passes():
        start = time.perf_counter()
        before = graph
        try:
            graph = p(graph, target)
            graph.lint()
        except OmniflowError as err:
            raise PassError(p.__name__, err) from err
        times[p.__name__] = time.perf_counter() - start
        if on_pass is not None:
            on_pass(p.__name__, before, graph, times[p.__name__])
    graph.meta["pass_times"] = times
    return graph
