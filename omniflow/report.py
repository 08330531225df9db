"""Human-readable tables of a Plan (what `omniflow compile` prints), rendered with rich.

The tables fit 80 columns, the width rich assumes when stdout is not a terminal: names
(stages, executors, edges, kernels) never wrap, other text wraps only at spaces, and what
would not fit beside the rest gets a table of its own instead of a narrow column: why each
executor holds its stages, each edge's buffer, the fused pointwise kernels.
"""

from __future__ import annotations

from rich import box
from rich.console import Console
from rich.measure import Measurement
from rich.table import Table

from omniflow.devices import human_bytes, node_of
from omniflow.plan import FRONTEND, ChannelPlan, Plan

_UNBOUNDED = 1 << 20  # columns, to measure what a table needs at the least


def _table(title: str | None, *columns: str, wrap: tuple[str, ...] = ()) -> Table:
    """A table whose `wrap` columns wrap at spaces; every other column stays on one line."""
    table = Table(
        title=title,
        box=box.SIMPLE_HEAD,
        title_justify="left",
        show_edge=False,
        pad_edge=False,
        collapse_padding=True,
    )
    for col in columns:
        table.add_column(col, no_wrap=col not in wrap, overflow="fold")
    return table


def _stages(plan: Plan) -> Table:
    # Executors are not repeated here: the executors table lists each one's stages.
    table = _table(
        f"pipeline {plan.pipeline}: stages",
        "stage",
        "kind",
        "device",
        "weights",
        "kv cache",
        "activations",
        "budget",
        wrap=("device",),
    )
    for s in plan.stages:
        table.add_row(
            s.name,
            s.kind,
            ", ".join(s.devices),
            human_bytes(s.weight_bytes),
            human_bytes(s.kv_cache_bytes),
            human_bytes(s.activation_bytes),
            human_bytes(s.budget_bytes),
        )
    return table


def _executors(plan: Plan) -> Table:
    """A row per stage, under its executor's name and devices: on a GPU, the priority of the
    stage's own CUDA stream (lower runs first); off GPUs, none ("-")."""
    table = _table("executors", "executor", "device", "stage", "stream priority", wrap=("device",))
    for x in plan.executors:
        for i, stage in enumerate(x.stage_names):
            priority = x.stream_priorities.get(stage)
            head = (x.name, ", ".join(x.devices)) if i == 0 else ("", "")
            table.add_row(*head, stage, "-" if priority is None else str(priority))
    return table


def _reasons(plan: Plan) -> Table:
    """Why each executor holds its stages, a row per reason: the reasons name edges, too
    long for a column beside the executors' devices and stages. Each row repeats the
    executor, so a reason that wraps is not read as the start of the next."""
    table = _table(None, "executor", "why", wrap=("why",))
    # On a cluster, where each stage went matters as much as what shares a process.
    nodes = any(node_of(d.name) for d in plan.devices)
    for x in plan.executors:
        for reason in x.reasons:
            table.add_row(x.name, reason)
        for stage in x.stages if nodes else ():
            for placed in stage.placed:
                table.add_row(x.name, f"{stage.name} on {placed}")
    return table


def _schedule(c: ChannelPlan) -> str:
    return "whole" if c.schedule is None else ", ".join(map(str, c.schedule)) + " ..."


def _buffer(c: ChannelPlan) -> str:
    if c.kind == "local":
        return "reference"
    where = f" on {c.device}" if c.device else ""
    return f"{c.slots} x {human_bytes(c.slot_bytes)} = {human_bytes(c.ring_bytes)}{where}"


def _edges(plan: Plan) -> Table:
    table = _table(
        "edges", "edge", "type", "item", "chunk schedule", wrap=("item", "chunk schedule")
    )
    for c in plan.channels:
        item = f"{c.item_dtype}[{', '.join(map(str, c.item_shape))}]"
        table.add_row(c.name, c.type, item, _schedule(c))
    return table


def _buffers(plan: Plan) -> Table:
    table = _table("buffers", "edge", "kind", "buffer", wrap=("buffer",))
    for c in plan.channels:
        table.add_row(c.name, c.kind, _buffer(c))
    return table


def _runs_with(c: ChannelPlan) -> str:
    """Where an edge's kernel runs, by the stage beside it there (an executor's name lists
    all its stages) or the frontend."""
    runs_in = c.pointwise.runs_in
    if runs_in == FRONTEND:
        return runs_in
    return c.src if runs_in == c.src_executor else c.dst


def _kernels(plan: Plan) -> Table:
    table = _table("fused pointwise kernels", "edge", "kernel", "dtypes", "runs with")
    for c in plan.channels:
        if c.pointwise:
            p = c.pointwise
            table.add_row(c.name, p.kernel, f"{p.in_dtype}->{p.out_dtype}", _runs_with(c))
    return table


def _devices(plan: Plan) -> Table:
    table = _table("devices", "device", "assigned", "contexts", "total", "usable")
    for d in plan.devices:
        contexts = f"{d.contexts} x {human_bytes(d.context_bytes)}" if d.contexts else "0"
        table.add_row(
            d.name,
            human_bytes(d.used_bytes),
            contexts,
            human_bytes(d.total_bytes),
            human_bytes(d.usable_bytes),
        )
    return table


def plan_tables(plan: Plan) -> list[Table]:
    tables = [_stages(plan), _executors(plan), _reasons(plan), _edges(plan), _buffers(plan)]
    if any(c.pointwise for c in plan.channels):
        tables.append(_kernels(plan))
    return [*tables, _devices(plan)]


def _fit(table: Table, console: Console) -> Table:
    """`table`, its longest names allowed to fold when they cannot stay whole beside the
    other columns' longest words: a long name cut once reads better than short values
    (shapes, sizes) cut into pieces, which is what rich would fold instead."""
    unbounded = console.options.update_width(_UNBOUNDED)  # rich clamps to the width given
    if Measurement.get(console, unbounded, table).minimum > console.width:
        names = [column for column in table.columns if column.no_wrap]
        widest = max(names, key=lambda column: max(map(len, map(str, column.cells))), default=None)
        if widest is not None:
            widest.no_wrap = False
    return table


def _rings(n: int) -> str:
    return f"{n} ring" + ("" if n == 1 else "s")


def render_plan(plan: Plan, console: Console, timings: bool = False) -> None:
    for table in plan_tables(plan):
        console.print(_fit(table, console))
        console.print()
    host = sum(c.kind != "local" and not c.device for c in plan.channels)
    console.print(f"shared memory: {human_bytes(plan.shm_bytes)} in {_rings(host)}")
    if plan.device_ring_bytes:
        on_device = sum(bool(c.device) for c in plan.channels)
        console.print(
            f"device memory: {human_bytes(plan.device_ring_bytes)} in {_rings(on_device)}"
        )
    for c in plan.channels:
        if c.carries_state:
            console.print(
                f"carried state: {c.dst} keeps each stream's decoder state from one chunk of "
                f"{c.name} to the next (no left context)"
            )
    for w in plan.warnings:
        console.print(f"warning: {w}", style="yellow")
    if timings:
        console.print(
            "passes: " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in plan.pass_seconds.items())
        )
