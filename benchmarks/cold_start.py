"""Claim (issue 12, §6): omni chat goes from nothing to its first answered request quickly --
at real size on one H200, compile + process start + weight load + graph capture + first
request within 45 s.

Reports each part of one cold start, in the order they happen:

- compile: the omni chat source to a plan (parse, passes, lowering);
- preflight: the plan checked against this machine (devices, models, speakers);
- process start, per executor: from the engine's start to that executor beginning to load
  its first stage (interpreter, imports, its control and start-queue ends);
- loads of an executor of several stages: from its first stage beginning to load to its last
  loaded (one after another, the sum of its stages' loads; at once, about the longest);
- load, per stage: what the executor reports in its `Loaded` message (the `loaded X in N s`
  line of `omniflow run`), and of that, the seconds it ran beside the executor's other loads
  (stages loaded at once) and capturing CUDA graphs (stages that decode from graphs:
  decode="graphs", the CUDA default);
- link: from the last stage loaded to the engine being ready (rings made and attached);
- first request, then a second one (what the first paid for being first).

`--load` runs one cold start per order, printed side by side: "sequential" (an executor's
stages one after another), "parallel" (at once, a thread each), "auto" (at once where two or
more of an executor's stages are on a GPU: the default).

    python benchmarks/cold_start.py                                  # tiny models, CPU
    python benchmarks/cold_start.py --devices 1xH200 --scaled 1 --load sequential parallel

The operating system's page cache keeps what the last start read, so a later start measures
a warmer one: the second order of a run, or a second run in the same place (the first run
after building a `--scaled` checkpoint writes it too; run once more for the figure). Name
the orders in both sequences (`--load parallel sequential` too) to see how much that is.
"""

from __future__ import annotations

import time

from streaming import GRAPH, model_arguments, parse_model_arguments, plan_for, run_engine

from omniflow.runtime import control
from omniflow.runtime.engine import Engine
from omniflow.runtime.loading import LOAD_ORDERS
from omniflow.runtime.preflight import preflight


def cold_start(plan, checks, order: str, max_tokens: int) -> dict[str, float]:
    """One cold start of `plan` with its executors loading their stages in `order`: each
    part's seconds, in the order they happen."""
    started = time.perf_counter()
    loaded: list[tuple[float, control.Loaded]] = []  # (when it reached the engine, message)
    with Engine(
        plan,
        "process",
        checks=checks,
        on_loaded=lambda m: loaded.append((time.perf_counter(), m)),
        load=order,
    ) as engine:
        ready = time.perf_counter()
        first = run_engine(engine, 1, max_tokens)[1][0]
        second = run_engine(engine, 1, max_tokens)[1][0]

    parts: dict[str, float] = {}
    arrived = {m.stage: (at, m) for at, m in loaded}
    for executor in plan.executors:
        # Its loads began when the first of its stages to say Loaded began (one after
        # another or at once alike): `seconds` before that message arrived.
        mine = [arrived[s] for s in executor.stage_names]
        at, m = min(mine, key=lambda pair: pair[0])
        parts[f"process start {executor.name}"] = at - m.seconds - started
        if len(mine) > 1:
            parts[f"loads of {executor.name}"] = max(at for at, _m in mine) - (at - m.seconds)
    for _at, m in loaded:
        parts[f"load {m.stage}"] = m.seconds
        if m.alongside:
            parts[f"  of which beside other stages {m.stage}"] = m.alongside
        if m.captured:
            parts[f"  of which graph capture {m.stage}"] = m.captured
    parts["link"] = ready - max(at for at, _m in loaded)
    parts["engine start to ready"] = ready - started
    parts["first request"] = first
    parts["second request"] = second
    return parts


def main() -> None:
    parser = model_arguments(max_tokens=16, audio_tokens=32)
    parser.add_argument(
        "--load",
        nargs="+",
        default=["auto"],
        choices=LOAD_ORDERS,
        help="how each executor loads its stages, one cold start per order, printed side by "
        "side (auto: at once where two or more of an executor's stages are on a GPU)",
    )
    args = parse_model_arguments(parser)

    began = time.perf_counter()
    plan = plan_for(GRAPH.read_text(), args.devices, args.model_dir, args.audio_tokens, "auto")
    compiled = time.perf_counter()
    checks = preflight(plan)
    checked = time.perf_counter()
    runs = [cold_start(plan, checks, order, args.max_tokens) for order in args.load]
    for run in runs:
        run["total to first answer"] = (
            checked - began + run["engine start to ready"] + run["first request"]
        )
    parts = ["compile", "preflight"]
    for run in runs:  # a part one run has and another lacks goes after its run's previous one
        for before, part in zip(["preflight", *run], run, strict=False):
            if part not in parts:
                parts.insert(parts.index(before) + 1, part)
    rows = {part: [run.get(part) for run in runs] for part in parts}
    rows["compile"] = [compiled - began] * len(runs)
    rows["preflight"] = [checked - compiled] * len(runs)
    print(f"{'part':<48}" + "".join(f" {'s, ' + order:>16}" for order in args.load))
    for part, values in rows.items():
        cells = "".join(f" {'-' if v is None else f'{v:.2f}':>16}" for v in values)
        print(f"{part:<48}{cells}")
    print(
        f"(devices {args.devices}; model {args.model_dir or 'tiny'}; {args.max_tokens} text "
        f"and {args.audio_tokens} codec tokens per request; executors start in parallel, so "
        "process start and load overlap across executors and do not add up, and so do the "
        "loads of one executor's stages loaded at once (`beside other stages`); a cold start "
        "after the first of a run finds the page cache warmer)"
    )


if __name__ == "__main__":
    main()
