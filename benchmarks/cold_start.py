"""Claim (issue 12, §6): omni chat goes from nothing to its first answered request quickly --
at real size on one H200, compile + process start + weight load + graph capture + first
request within 45 s.

Reports each part of one cold start, in the order they happen:

- compile: the omni chat source to a plan (parse, passes, lowering);
- preflight: the plan checked against this machine (devices, models, speakers);
- process start, per executor: from the engine's start to that executor beginning to load
  its first stage (interpreter, imports, its control and start-queue ends);
- load, per stage: what the executor reports in its `Loaded` message (the `loaded X in N s`
  line of `omniflow run`), and of that, capturing CUDA graphs (stages that decode from
  graphs: decode="graphs", the CUDA default);
- link: from the last stage loaded to the engine being ready (rings made and attached);
- first request, then a second one (what the first paid for being first).

    python benchmarks/cold_start.py                                  # tiny models, CPU
    python benchmarks/cold_start.py --devices 1xH200 --scaled 1      # real size, one H200

One cold start per run: the operating system's page cache keeps what the last run read, so
a second run in the same place measures a warmer start (the first run after building a
`--scaled` checkpoint writes it too; run once more for the figure).
"""

from __future__ import annotations

import time

from streaming import GRAPH, model_arguments, parse_model_arguments, plan_for, run_engine

from omniflow.runtime import control
from omniflow.runtime.engine import Engine
from omniflow.runtime.preflight import preflight


def main() -> None:
    args = parse_model_arguments(model_arguments(max_tokens=16, audio_tokens=32))

    began = time.perf_counter()
    plan = plan_for(GRAPH.read_text(), args.devices, args.model_dir, args.audio_tokens, "auto")
    compiled = time.perf_counter()
    checks = preflight(plan)
    checked = time.perf_counter()
    loaded: list[tuple[float, control.Loaded]] = []  # (when it reached the engine, message)
    with Engine(
        plan, "process", checks=checks, on_loaded=lambda m: loaded.append((time.perf_counter(), m))
    ) as engine:
        ready = time.perf_counter()
        first = run_engine(engine, 1, args.max_tokens)[1][0]
        second = run_engine(engine, 1, args.max_tokens)[1][0]

    rows = [("compile", compiled - began), ("preflight", checked - compiled)]
    arrived = {m.stage: (at, m) for at, m in loaded}
    for executor in plan.executors:
        # An executor loads its stages one after another: it began loading the first
        # `seconds` before that stage's Loaded arrived.
        at, m = min((arrived[s] for s in executor.stage_names), key=lambda pair: pair[0])
        rows.append((f"process start {executor.name}", at - m.seconds - checked))
    for _at, m in loaded:
        rows.append((f"load {m.stage}", m.seconds))
        if m.captured:
            rows.append((f"  of which graph capture {m.stage}", m.captured))
    rows.append(("link", ready - max(at for at, _m in loaded)))
    rows += [("first request", first), ("second request", second)]
    rows.append(("total to first answer", ready - began + first))
    print(f"{'part':<40} {'s':>8}")
    for part, seconds in rows:
        print(f"{part:<40} {seconds:>8.2f}")
    print(
        f"(devices {args.devices}; model {args.model_dir or 'tiny'}; {args.max_tokens} text "
        f"and {args.audio_tokens} codec tokens per request; executors start in parallel, so "
        "process start and load overlap across executors and do not add up)"
    )


if __name__ == "__main__":
    main()
