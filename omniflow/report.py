"""Human-readable tables of a Plan (what `omniflow compile` prints), rendered with rich."""

from __future__ import annotations

from rich import box
from rich.console import Console
from rich.table import Table

from omniflow.plan import Plan


def human_bytes(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def _table(title: str, *columns: str) -> Table:
    table = Table(title=title, box=box.SIMPLE_HEAD, title_justify="left", pad_edge=False)
    for col in columns:
        table.add_column(col, overflow="fold")
    return table


def plan_tables(plan: Plan) -> list[Table]:
    stages = _table(
        f"pipeline {plan.pipeline}: stages",
        "stage",
        "kind",
        "device",
        "executor",
        "weights",
        "kv cache",
        "activations",
        "budget",
    )
    for s in plan.stages:
        stages.add_row(
            s.name,
            s.kind,
            ",".join(s.devices),
            s.executor,
            human_bytes(s.weight_bytes),
            human_bytes(s.kv_cache_bytes),
            human_bytes(s.activation_bytes),
            human_bytes(s.budget_bytes),
        )
    executors = _table("executors", "executor", "device", "stages", "why")
    for x in plan.executors:
        executors.add_row(x.name, ",".join(x.devices), ", ".join(x.stages), "\n".join(x.reasons))
    channels = _table("edges", "edge", "type", "item", "kind", "chunk schedule", "buffer")
    for c in plan.channels:
        schedule = "whole" if c.schedule is None else ", ".join(map(str, c.schedule)) + " ..."
        item = f"{c.item_dtype}[{', '.join(map(str, c.item_shape))}]"
        if c.pointwise:
            item += f"\n{c.pointwise['kernel']} ({c.pointwise['in_dtype']}->{c.pointwise['out_dtype']}) in {c.pointwise['runs_in']}"
        buffer = (
            "reference"
            if c.kind == "local"
            else f"{c.slots} x {human_bytes(c.slot_bytes)} = {human_bytes(c.ring_bytes)}"
        )
        channels.add_row(c.name, c.type, item, c.kind, schedule, buffer)
    devices = _table("devices", "device", "assigned", "usable")
    for d in plan.devices:
        devices.add_row(d["name"], human_bytes(d["used_bytes"]), human_bytes(d["usable_bytes"]))
    return [stages, executors, channels, devices]


def render_plan(plan: Plan, console: Console, timings: bool = False) -> None:
    for table in plan_tables(plan):
        console.print(table)
    console.print(
        f"shared memory: {human_bytes(plan.shm_bytes)} in "
        f"{sum(c.kind == 'shm' for c in plan.channels)} rings"
    )
    for w in plan.warnings:
        console.print(f"warning: {w}", style="yellow")
    if timings:
        console.print(
            "passes: " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in plan.pass_seconds.items())
        )
