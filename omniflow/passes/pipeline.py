"""The ordered pass pipeline: runs each pass, times it, lints after it, names it in errors,
and holds it to what its module declares it writes (`WRITES`: `meta` keys, see facts.py)."""

from __future__ import annotations

import sys
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
            _check_writes(p, before, graph)
        except OmniflowError as err:
            raise PassError(p.__name__, err) from err
        times[p.__name__] = time.perf_counter() - start
        if on_pass is not None:
            on_pass(p.__name__, before, graph, times[p.__name__])
    graph.meta["pass_times"] = times
    return graph


def _written(before: Graph, after: Graph) -> set[str]:
    """The `meta` keys `after` holds new or replaced values under, on the graph, its nodes
    and its edges."""
    pairs = [(before.meta, after.meta)]
    pairs += [(before.node(n.name).meta, n.meta) for n in after.nodes]
    pairs += [(b.meta, a.meta) for b, a in zip(before.edges, after.edges, strict=True)]
    return {k for old, new in pairs for k, v in new.items() if k not in old or old[k] is not v}


def _check_writes(p: Pass, before: Graph, after: Graph) -> None:
    """A pass whose module declares `WRITES` writes no other `meta` key."""
    declared = getattr(sys.modules.get(p.__module__), "WRITES", None)
    if declared is None:
        return
    stray = _written(before, after) - set(declared)
    if stray:
        raise OmniflowError(f"wrote meta {', '.join(sorted(stray))}, which it does not declare")
