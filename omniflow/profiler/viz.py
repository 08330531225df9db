"""`omniflow compile PIPELINE.omni --viz out.html`: the graph as each pass left it, steppable,
with what each pass changed highlighted — models resolved, types inferred, costs estimated,
devices placed, stages fused, map chains fused, chunk schedules sized, buffers planned — so
a reader sees why the plan is what it is.

`PassSnapshots` is the `on_pass` hook of `run_passes` (passes/pipeline.py): it keeps a
drawing of the graph before the first pass and after each, and what each pass changed in
every node's, edge's and the graph's `meta`. `render_viz` makes the page.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from omniflow.devices import human_bytes
from omniflow.ir.graph import INPUT, OUTPUT, Edge, Graph, Node
from omniflow.ir.values import AUTO, format_value
from omniflow.profiler.graphs import buffer_text, schedule_text
from omniflow.profiler.html import page

# What each meta key is about: the page colours a change by it.
CATEGORIES = {
    "model": "models",
    "ports": "types",
    "item": "types",
    "attrs": "types",
    "cost": "costs",
    "placement": "devices",
    "devices": "devices",
    "executor": "fusion",
    "executors": "fusion",
    "pointwise": "fusion",
    "schedule": "chunks",
    "carries_state": "chunks",
    "plays_s": "chunks",
    "channel": "buffers",
    "shm_bytes": "buffers",
}
BYTES_KEYS = ("need", "budget", "used", "usable", "shm_bytes")
SHOWN_CHARS = 220


def show(value, key: str = "") -> str:
    """A meta value as one short line."""
    text = _show(value, key, 0)
    return text if len(text) <= SHOWN_CHARS else text[: SHOWN_CHARS - 1] + "…"


def _show(value, key: str, depth: int) -> str:
    if isinstance(value, bool) or value is None:
        return str(value)
    if isinstance(value, int) and (key.endswith("_bytes") or key in BYTES_KEYS):
        return human_bytes(value)
    if isinstance(value, (int, float, str)):
        return str(value) if not isinstance(value, str) or depth == 0 else repr(value)
    if depth > 2:
        return "…"
    if isinstance(value, dict):
        items = list(value.items())
        body = ", ".join(f"{k}: {_show(v, str(k), depth + 1)}" for k, v in items[:8])
        return "{" + body + (", …" if len(items) > 8 else "") + "}"
    if isinstance(value, (list, tuple)):
        body = ", ".join(_show(v, key, depth + 1) for v in value[:8])
        return "[" + body + (", …" if len(value) > 8 else "") + "]"
    if type(value).__str__ is not object.__str__ and not dataclasses.is_dataclass(value):
        return str(value)
    if dataclasses.is_dataclass(value):
        if "__str__" in type(value).__dict__:
            return str(value)
        fields = [
            f"{f.name}={_show(getattr(value, f.name), f.name, depth + 1)}"
            for f in dataclasses.fields(value)
            if not isinstance(getattr(value, f.name), dict) or depth == 0
        ]
        return f"{type(value).__name__}({', '.join(fields)})"
    return str(value)


def _fingerprint(value) -> str:
    return repr(value)


@dataclasses.dataclass
class Snapshot:
    name: str  # "source", or the pass that made it
    seconds: float
    graph: dict  # the drawing (common.js drawGraph's model)
    changes: list[dict]  # {"where", "key", "category", "value", "was"}


class PassSnapshots:
    """The `on_pass` hook: records the graph before the first pass and after each one."""

    def __init__(self):
        self.snapshots: list[Snapshot] = []
        self._prints: dict = {}

    def __call__(self, name: str, before: Graph, after: Graph, seconds: float) -> None:
        if not self.snapshots:
            self._add("source", before, 0.0)
        self._add(name, after, seconds)

    def _add(self, name: str, graph: Graph, seconds: float) -> None:
        prints = _prints(graph)
        changes = []
        for (where, key), (fingerprint, value) in prints.items():
            old = self._prints.get((where, key))
            if self.snapshots and (old is None or old[0] != fingerprint):
                changes.append(
                    {
                        "where": where,
                        "key": key,
                        "category": CATEGORIES.get(key, "other"),
                        "value": show(value, key),
                        "was": None if old is None else show(old[1], key),
                    }
                )
        self._prints = prints
        changed: dict[str, set[str]] = {}
        for c in changes:
            changed.setdefault(c["where"], set()).add(c["category"])
        self.snapshots.append(Snapshot(name, seconds, graph_model(graph, changed), changes))


def _prints(graph: Graph) -> dict:
    out = {}
    for node in graph.nodes:
        for key, value in node.meta.items():
            out[node.name, key] = (_fingerprint(value), value)
    for edge in graph.edges:
        for key, value in edge.meta.items():
            out[edge.name, key] = (_fingerprint(value), value)
    for key, value in graph.meta.items():
        if key != "pass_times":
            out["graph", key] = (_fingerprint(value), value)
    return out


def _node_lines(graph: Graph, node: Node) -> list[str]:
    meta = node.meta
    if node.op in (INPUT, OUTPUT):
        lines = [f"{node.op} · {node.params.get('type', '')}".rstrip(" ·")]
    else:
        params = {k: v for k, v in node.params.items() if k in ("component", "model", "fn")}
        lines = [f"{node.op}({', '.join(f'{k}={format_value(v)}' for k, v in params.items())})"]
    if "model" in meta:
        config = meta["model"].config
        lines.append(f"model {config.model} ({config.category})")
    if "ports" in meta and meta["ports"].out:
        ports = [f"{p} {s.step}" for p, s in meta["ports"].out.items()]
        lines.append("out: " + ", ".join(ports[:3]) + (" …" if len(ports) > 3 else ""))
    cost = meta["cost"].cost if "cost" in meta else None
    if cost is not None:
        lines.append(
            f"weights {human_bytes(cost.weight_bytes)} · kv {human_bytes(cost.kv_cache_bytes)}"
            f" · batch {meta['cost'].batch}"
        )
    if "placement" in meta:
        placement = meta["placement"]
        lines.append(f"on {placement.device} · budget {human_bytes(placement.budget)}")
    elif node.device:
        lines.append(f"pinned to {node.device}")
    return lines


def _edge_lines(edge: Edge) -> list[str]:
    meta = edge.meta
    first = edge.type + (f" {meta['item'].item}" if "item" in meta else "")
    if "schedule" in meta:
        chunk = schedule_text(meta["schedule"])
    elif edge.chunk is None:
        chunk = "whole"
    else:
        chunk = "chunk auto" if edge.chunk is AUTO else f"chunk {format_value(edge.chunk)}"
    lines = [f"{first} · {chunk}"]
    if "channel" in meta:
        ring = meta["channel"]
        fields = ("kind", "slots", "slot_bytes", "ring_bytes")
        lines.append(buffer_text({f: getattr(ring, f) for f in fields}))
    if "pointwise" in meta:
        lines.append(f"map → {meta['pointwise'].kernel}")
    elif edge.maps:
        lines.append("map " + " | ".join(str(m) for m in edge.maps))
    return lines


def graph_model(graph: Graph, changed: dict[str, set[str]] | None = None) -> dict:
    """The drawing of an IR graph as passes have annotated it so far: stages in executor
    boxes (once fused) in device boxes (once placed); `changed` marks what the last pass
    touched."""
    changed = changed or {}
    clusters: list[dict] = []
    parent: dict[str, str] = {}
    devices = {n.meta["placement"].device for n in graph.stages if "placement" in n.meta}
    usage = {d.name: d for d in graph.meta.get("devices", ())}
    for device in sorted(devices):
        label = f"device {device}"
        if device in usage:
            use = usage[device]
            label += f" · {human_bytes(use.used)} needed of {human_bytes(use.usable)}"
        clusters.append({"id": f"device:{device}", "label": label, "cls": "device"})
    for x in graph.meta.get("executors", ()):
        fused = len(x.stages) > 1
        device = x.devices[0] if x.devices else None
        cid = f"executor:{x.name}"
        clusters.append(
            {
                "id": cid,
                "label": f"executor {x.name}" + (" (fused)" if fused else ""),
                "parent": f"device:{device}" if device in devices else None,
                "cls": "executor fused" if fused else "executor",
                "title": "\n".join(x.reasons),
            }
        )
        for stage in x.stages:
            parent[stage] = cid
    for node in graph.stages:
        if node.name not in parent and "placement" in node.meta:
            parent[node.name] = f"device:{node.meta['placement'].device}"
    nodes = []
    for node in graph.topo_order():
        cls = "stage" if node.is_stage else "port"
        if node.name in changed:
            cls += " changed"
        nodes.append(
            {
                "id": node.name,
                "label": node.name,
                "sub": _node_lines(graph, node),
                "cls": cls,
                "parent": parent.get(node.name),
                "changed": sorted(changed.get(node.name, ())),
            }
        )
    edges = []
    for edge in graph.edges:
        local = "channel" in edge.meta and edge.meta["channel"].kind == "local"
        cls = ("local" if local else "shm") + (" changed" if edge.name in changed else "")
        edges.append(
            {
                "id": edge.name,
                "from": edge.src,
                "to": edge.dst,
                "label": _edge_lines(edge),
                "cls": cls,
                "title": edge.name,
                "changed": sorted(changed.get(edge.name, ())),
            }
        )
    return {"clusters": clusters, "nodes": nodes, "edges": edges}


BODY = """
<main>
  <div class="passes" id="passes"></div>
  <div class="row">
    <div class="col" style="flex: 3 1 600px">
      <div class="graph" id="graph"></div>
    </div>
    <div class="col card" style="flex: 1 1 340px">
      <h3 id="pass-title"></h3>
      <div class="muted" id="pass-about"></div>
      <div class="legend" id="legend"></div>
      <ul class="changes" id="changes"></ul>
    </div>
  </div>
</main>
"""

ABOUT = {
    "source": "The graph as the program built it: stages, ports and edges, before any pass.",
    "resolve_models": "Where each stage's model config comes from.",
    "infer_types": "The dtype and shape of every port's step, after adapters and map chains.",
    "estimate_costs": "Weights, KV cache, activations and FLOPs per item of each stage.",
    "place": "A device and an explicit memory budget for each stage.",
    "fuse_stages": "Which stages share an executor process, and why each boundary stays.",
    "fuse_pointwise": "One generated kernel per map chain, and which side of the hop runs it.",
    "size_chunks": "A concrete chunk schedule for every streamed edge.",
    "plan_buffers": "A shared-memory ring for every edge between executors.",
}


def viz_data(snapshots: PassSnapshots, pipeline: str, devices: str = "") -> dict:
    return {
        "title": f"omniflow compile: {pipeline}",
        "devices": devices,
        "passes": [
            {
                "name": s.name,
                "seconds": s.seconds,
                "about": ABOUT.get(s.name, ""),
                "graph": s.graph,
                "changes": s.changes,
            }
            for s in snapshots.snapshots
        ],
    }


def render_viz(snapshots: PassSnapshots, pipeline: str, devices: str = "") -> str:
    data = viz_data(snapshots, pipeline, devices)
    return page(data["title"], BODY, "viz.js", data)


def write_viz(snapshots: PassSnapshots, out: str | Path, pipeline: str, devices: str = "") -> Path:
    out = Path(out)
    out.write_text(render_viz(snapshots, pipeline, devices), encoding="utf-8")
    return out
