"""Printing a Graph: a readable listing (`str(graph)`) and `.omni` source (`to_dsl`).

The listing shows what the passes wrote (passes/facts.py, each fact printing itself as one
short phrase): a node's facts and an edge's on its line, after `#`; the graph's own
(executors, devices, shared-memory bytes, warnings) on lines after the edges.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from omniflow.devices import human_bytes
from omniflow.ir.values import AUTO, format_value

if TYPE_CHECKING:
    from omniflow.ir.graph import Edge, Graph, Node


def _call_args(params: dict) -> str:
    return ", ".join(f"{k}={format_value(v)}" for k, v in params.items())


def _edge_attrs(edge: Edge) -> list[str]:
    attrs = []
    if edge.chunk is AUTO:
        attrs.append("stream")
    elif edge.chunk is not None:
        attrs += ["stream", f"chunk={format_value(edge.chunk)}"]
    if edge.context:
        attrs.append(f"context={edge.context}")
    if edge.credits is not None:
        attrs.append(f"credits={edge.credits}")
    if edge.adapter:
        attrs.append(f"adapter={edge.adapter}")
    return attrs


def _flow(graph: Graph, edge: Edge) -> str:
    src = graph.node(edge.src)
    dst = graph.node(edge.dst)
    text = edge.src if src.op == "input" else f"{edge.src}.{edge.src_port}"
    if edge.maps:
        text += f" -> map({' | '.join(str(op) for op in edge.maps)})"
    attrs = _edge_attrs(edge)
    if dst.op == "output":
        text += f" -> output {dst.name}"
        attrs += [f"{k}={format_value(v)}" for k, v in dst.params.items()]
    else:
        text += f" -> {edge.dst}.{edge.dst_port}"
    return text + (f" [{', '.join(attrs)}]" if attrs else "")


def to_dsl(graph: Graph) -> str:
    lines = [f"pipeline {graph.name} {{"]
    if graph.model:
        lines.append(f"  model {format_value(graph.model)}")
    lines += [f"  param {k} = {format_value(v)}" for k, v in graph.params.items()]
    for node in graph.stages:
        device = f" @ {node.device}" if node.device else ""
        lines.append(f"  stage {node.name} = {node.op}({_call_args(node.params)}){device}")
    for node in graph.inputs:
        default = node.params.get("default")
        tail = "" if default is None else f" = {format_value(default)}"
        mark = "?" if node.params.get("optional") else ""
        lines.append(f"  input {node.name}: {node.params['type']}{mark}{tail}")
    lines += [f"  {_flow(graph, e)}" for e in graph.edges]
    lines += [f"  {c.kind} {', '.join(c.stages)}" for c in graph.constraints]
    return "\n".join(lines + ["}"]) + "\n"


def _fact(key: str, value) -> str:
    """A fact as one phrase ("" for none): a flag "yes" where set (unset: nothing), a tuple
    (a chunk schedule: its sizes, the last repeating) comma separated, a byte count as one
    reads it."""
    if value is None or value is False:  # a whole-output edge's schedule; a flag unset
        return ""
    if value is True:
        return "yes"
    if isinstance(value, (tuple, list)):
        return ",".join(map(str, value))
    if key.endswith("_bytes") and isinstance(value, int):
        return human_bytes(value)
    return str(value)


def _facts(node_or_edge: Node | Edge) -> str:
    facts = ((key, _fact(key, value)) for key, value in node_or_edge.meta.items())
    shown = [f"{key}={text}" for key, text in facts if text]
    return ("  # " + "  ".join(shown)) if shown else ""


def _graph_facts(graph: Graph) -> list[str]:
    """One line per graph-wide fact (per item of one that is a tuple: an executor, a device,
    a warning)."""
    lines = []
    for key, value in graph.meta.items():
        if key == "pass_times":  # how long the passes took: about this run, not the graph
            continue
        for item in value if isinstance(value, tuple) else (value,):
            lines.append(f"  {key}: {_fact(key, item)}")
    return lines


def format_graph(graph: Graph) -> str:
    """A listing in topological order: one line per node, then one per edge."""
    head = f"graph {graph.name}"
    if graph.model:
        head += f"  model={graph.model}"
    if graph.params:
        head += "  params: " + ", ".join(f"{k}={format_value(v)}" for k, v in graph.params.items())
    lines = [head]
    for node in graph.topo_order():
        if node.op == "input":
            body = f"input  {node.name}: {node.params['type']}"
            body += "?" if node.params.get("optional") else ""
        elif node.op == "output":
            body = f"output {node.name}" + (f"({_call_args(node.params)})" if node.params else "")
        else:
            body = f"stage  {node.name} = {node.op}({_call_args(node.params)})"
            body += f" @ {node.device}" if node.device else ""
        lines.append(f"  {body}{_facts(node)}")
    for edge in graph.edges:
        extra = " ".join(_edge_attrs(edge))
        maps = f" map({' | '.join(str(op) for op in edge.maps)})" if edge.maps else ""
        lines.append(f"  edge   {edge.name} : {edge.type}{maps} {extra}".rstrip() + _facts(edge))
    lines += [f"  {c.kind} {', '.join(c.stages)}" for c in graph.constraints]
    return "\n".join(lines + _graph_facts(graph))
