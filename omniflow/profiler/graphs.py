"""A compiled plan as the graph the pages draw (common.js `drawGraph`): a box per stage in a
box per executor (a fused group when it holds several stages) in a box per device with its
memory budgets; the pipeline's inputs and outputs; an arrow per channel labelled with its
type, chunk schedule, buffer (ring slots x slot bytes, or a local reference) and fused map
chain."""

from __future__ import annotations

from omniflow.devices import human_bytes
from omniflow.plan import FRONTEND


def schedule_text(schedule: list[int] | None, limit: int = 4) -> str:
    if schedule is None:
        return "whole"
    shown = ",".join(map(str, schedule[:limit]))
    return f"chunk {shown}{'…' if len(schedule) > limit else ''}"


def buffer_text(channel: dict) -> str:
    if channel.get("kind") == "local":
        return "local: reference"
    return (
        f"ring {channel.get('slots', 0)}×{human_bytes(channel.get('slot_bytes', 0))}"
        f" = {human_bytes(channel.get('ring_bytes', 0))}"
    )


def edge_label(channel: dict) -> list[str]:
    lines = [f"{channel.get('type', '')} · {schedule_text(channel.get('schedule'))}"]
    lines.append(buffer_text(channel))
    pointwise = channel.get("pointwise")
    if pointwise:
        lines.append(f"map → {pointwise.get('kernel', 'fused kernel')}")
    elif channel.get("maps"):
        lines.append("map " + " | ".join(channel["maps"]))
    return lines


def device_budgets(plan: dict) -> list[dict]:
    """Per device: its usable memory, what its stages need, and each stage's budget."""
    devices = {d["name"]: d for d in plan.get("devices", [])}
    rows: dict[str, dict] = {
        name: {
            "device": name,
            "usable_bytes": d.get("usable_bytes", 0),
            "used_bytes": d.get("used_bytes", 0),
            "stages": [],
        }
        for name, d in devices.items()
    }
    for s in plan["stages"]:
        device = (s.get("devices") or ["cpu"])[0]
        row = rows.setdefault(
            device, {"device": device, "usable_bytes": 0, "used_bytes": 0, "stages": []}
        )
        row["stages"].append(
            {"stage": s["name"], "budget_bytes": s["budget_bytes"], "need_bytes": s["need_bytes"]}
        )
    return list(rows.values())


def _stage_lines(s: dict) -> list[str]:
    model = ":".join(x for x in (s.get("model"), s.get("component")) if x)
    batch = s.get("settings", {}).get("max_batch", s.get("batch", 1))
    weights = human_bytes(s.get("weight_bytes", 0))
    return [
        f"{s['kind']} · {model}" if model else s["kind"],
        f"batch {batch} · budget {human_bytes(s['budget_bytes'])}",
        f"needs {human_bytes(s['need_bytes'])} (weights {weights})",
    ]


def plan_graph(plan: dict) -> dict:
    """The graph model of a plan (`msgspec.to_builtins(plan)`, or a trace's
    `otherData["plan"]`)."""
    clusters, nodes, edges = [], [], []
    for d in device_budgets(plan):
        label = f"device {d['device']}"
        if d["usable_bytes"]:
            label += f" · {human_bytes(d['used_bytes'])} needed of {human_bytes(d['usable_bytes'])}"
        budgets = ", ".join(f"{s['stage']} {human_bytes(s['budget_bytes'])}" for s in d["stages"])
        clusters.append(
            {
                "id": f"device:{d['device']}",
                "label": label,
                "cls": "device",
                "title": f"budgets: {budgets}" if budgets else "",
            }
        )
    for program in plan["programs"]:
        if program["name"] == FRONTEND:
            continue
        names = [s["name"] for s in program["stages"]]
        device = (program.get("devices") or ["cpu"])[0]
        fused = len(names) > 1
        clusters.append(
            {
                "id": f"executor:{program['name']}",
                "label": f"executor {program['name']}" + (" (fused)" if fused else ""),
                "parent": f"device:{device}",
                "cls": "executor fused" if fused else "executor",
                "title": "\n".join(program.get("reasons", [])),
            }
        )
    for s in plan["stages"]:
        nodes.append(
            {
                "id": s["name"],
                "label": s["name"],
                "sub": _stage_lines(s),
                "cls": "stage",
                "parent": f"executor:{s['executor']}",
            }
        )
    for side in ("input", "output"):
        for port in plan.get(f"{side}s", []):
            sub = [f"{side} · {port['type']}"]
            nodes.append({"id": port["name"], "label": port["name"], "sub": sub, "cls": "port"})
    for c in plan["channels"]:
        edges.append(
            {
                "id": c["name"],
                "from": c["src"],
                "to": c["dst"],
                "label": edge_label(c),
                "cls": "local" if c.get("kind") == "local" else "shm",
                "title": c["name"],
            }
        )
    return {"clusters": clusters, "nodes": nodes, "edges": edges}
