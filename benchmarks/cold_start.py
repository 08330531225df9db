"""Claims: a graph goes from nothing to ready, and to its first answered request, quickly.
Omni chat (issue 12, §6): at real size on one H200, compile + process start + weight load +
graph capture + first request within 45 s. Qwen3-TTS (issue 37): process start -> ready
within 20 s on one H200, the build cached.

Reports each part of one cold start of `--graph` (default graphs/omni_chat.omni), in the
order they happen:

- compile: the graph's source to a plan (parse, passes, lowering);
- preflight: the plan checked against this machine (devices, models, speakers);
- process start, per executor: from the engine's start to that executor beginning to load
  its first stage (interpreter, imports, its control and start-queue ends), and of that,
  what its `Started` message says: its Python's start and imports (from its spawn), and
  creating its GPUs' CUDA contexts;
- load, per stage: what the executor reports in its `Loaded` message (the `loaded X in N s`
  line of `omniflow run`), and of that, capturing CUDA graphs (stages that decode from
  graphs: decode="graphs", the CUDA default), with what the capture ran (graphs, warm-ups,
  positions: `StaticDecoder.capture_work`);
- link: from the last stage loaded to the engine being ready;
- loads of an executor of several stages: from its first stage beginning to load to its last
  loaded (one after another, the sum of its stages' loads; at once, about the longest), and
  per stage the seconds it ran beside the executor's other loads;
- ready: process start -> ready (from the engine's start; compile and preflight excluded);
- first request, then a second one (what the first paid for being first): `--inputs`, a
  request's inputs as JSON (omni chat's default: a prompt; another graph's: none, and no
  request is sent), with `--params`;
- memory after load, a row per GPU and load order (on CUDA only): the plan's total for it
  (its stages' budgets plus the CUDA contexts of its executor processes: the devices table
  of `omniflow compile`), what torch reserved there once the stages loaded and how much of
  it is in tensors (each executor process's `Memory` message, summed over those on the
  GPU), and the GPU's bytes in use
  (every process's, contexts included: the most any executor saw).

    python benchmarks/cold_start.py                                  # tiny models, CPU
    python benchmarks/cold_start.py --devices 1xH200 --scaled 1      # real size, one H200
    python benchmarks/cold_start.py --graph graphs/qwen3_tts.omni --tiny \\
        --inputs '{"text": "Hello there.", "voice": "Vivian"}' --params '{"max_tokens": 8}'
    python benchmarks/cold_start.py --graph graphs/qwen3_tts.omni --devices 1xH200 --scaled 1

`--load` runs one cold start per order, printed side by side: "sequential" (an executor's
stages one after another: the default), "parallel" (at once, a thread each), "auto" (at once
where two or more of an executor's stages are on a GPU). The page cache favours whichever
start comes later: name the orders both ways (`--load sequential parallel parallel
sequential`) to see how much.

    python benchmarks/cold_start.py --devices 1xH200 --scaled 1 --load sequential parallel

`--scaled DEPTH` loads a random-weight build of the graph's model at its real widths and
DEPTH x its layers (built once into the cache); `--tiny` (the default without `--scaled` or
`--model-dir`) its tiny models. One cold start per run: the operating system's page cache
keeps what the last run read, so a second run in the same place measures a warmer start
(the first run after building a `--scaled` checkpoint writes it too; run once more for the
figure).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from streaming import GRAPH, PROMPTS, plan_for

from omniflow.catalog.resolve import use_tiny_models
from omniflow.checkpoints.scaled import scaled_checkpoint
from omniflow.compiler import compile_graph, graph_from_source
from omniflow.devices import human_bytes
from omniflow.runtime import control
from omniflow.runtime.engine import Engine
from omniflow.runtime.loading import LOAD_ORDERS
from omniflow.runtime.preflight import preflight

# The codec tokens of an omni chat request's speech.
OMNI_AUDIO_TOKENS = 32
MEMORY_COLUMNS = ("planned", "reserved", "in tensors", "used")


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--graph", type=Path, default=GRAPH, help="the .omni graph")
    parser.add_argument("--devices", default="cpu")
    models = parser.add_mutually_exclusive_group()
    models.add_argument("--tiny", action="store_true", help="its tiny models (the default)")
    models.add_argument("--model-dir", help="a checkpoint for the graph's model")
    models.add_argument(
        "--scaled", type=float, metavar="DEPTH", help="a random-weight build at DEPTH x layers"
    )
    parser.add_argument("--inputs", type=json.loads, help="a request's inputs, as JSON")
    parser.add_argument("--params", type=json.loads, default=None, help="its parameters")
    parser.add_argument(
        "--load",
        nargs="+",
        default=["sequential"],
        choices=LOAD_ORDERS,
        help="how each executor loads its stages, one cold start per order, side by side",
    )
    args = parser.parse_args()
    args.graph = args.graph.resolve()
    if args.scaled:  # built (once, into the cache) before the clock starts
        model = graph_from_source(args.graph.read_text(), str(args.graph)).model
        device = "cpu" if args.devices == "cpu" else "cuda"
        args.model_dir = str(scaled_checkpoint(model, args.scaled, device))
    if args.inputs is None and args.graph == GRAPH:
        args.inputs = {"prompt": PROMPTS[0]}
        args.params = args.params or {"max_tokens": 16}
    torch.set_num_threads(1)  # (the executors have the cores)
    return args


def plan_of(args: argparse.Namespace):
    if args.graph == GRAPH:  # omni chat's talker bounded: random weights rarely end speech
        return plan_for(
            args.graph.read_text(), args.devices, args.model_dir, OMNI_AUDIO_TOKENS, "auto"
        )
    graph = graph_from_source(args.graph.read_text(), str(args.graph))
    if args.model_dir:
        graph = graph.copy()
        graph.model = args.model_dir
    else:
        graph = use_tiny_models(graph)
    return compile_graph(graph, args.devices)


def request_seconds(engine: Engine, inputs: dict, params: dict | None) -> float:
    """Seconds to one request's last output chunk."""
    start = time.perf_counter()
    for _ in engine.stream_sync(inputs, params):
        pass
    return time.perf_counter() - start


def memory_rows(plan, reports: list[control.Memory], order: str) -> list[list[str]]:
    """A row per GPU the executors reported on: planned (the plan's total), reserved and in
    tensors (summed over its executor processes) and used (the most any of them saw), after
    `order`'s loads."""
    rows = []
    for device in plan.devices:
        here = [m for m in reports if m.device == device.name]
        if here:
            reserved, used = sum(m.reserved for m in here), max(m.used for m in here)
            sizes = (device.total_bytes, reserved, sum(m.allocated for m in here), used)
            rows.append([f"{device.name}, {order}", *map(human_bytes, sizes)])
    return rows


def cold_start(
    plan, checks, order: str, args: argparse.Namespace
) -> tuple[dict, list[str], list[list[str]]]:
    """One cold start of `plan` with its executors loading their stages in `order`: each
    part's seconds, in the order they happen, what each stage's capture ran, and what the
    loads left on each GPU (`memory_rows`)."""
    began = time.perf_counter()
    said: list[tuple[float, control.StartupReport]] = []  # (when it reached the engine, it)
    requests = []
    with Engine(
        plan,
        "process",
        checks=checks,
        on_loaded=lambda m: said.append((time.perf_counter(), m)),
        load=order,
    ) as engine:
        ready = time.perf_counter()
        if args.inputs is not None:
            requests = [request_seconds(engine, args.inputs, args.params) for _ in range(2)]
    loaded = [(at, m) for at, m in said if isinstance(m, control.Loaded)]
    up_at = {m.executor: m for _at, m in said if isinstance(m, control.Started)}
    memory = [m for _at, m in said if isinstance(m, control.Memory)]

    parts: dict[str, float] = {}
    arrived = {m.stage: (at, m) for at, m in loaded}
    for executor in plan.executors:
        # Its loads began when the first of its stages to say Loaded began (one after
        # another or at once alike): `seconds` before that message arrived.
        mine = [arrived[s] for s in executor.stage_names]
        at, m = min(mine, key=lambda pair: pair[0])
        parts[f"process start {executor.name}"] = at - m.seconds - began
        up = up_at.get(executor.name)
        if up is not None and up.python is not None:
            parts[f"  of which Python and imports {executor.name}"] = up.python
        if up is not None and up.cuda:
            parts[f"  of which CUDA context {executor.name}"] = up.cuda
        if len(mine) > 1:
            parts[f"loads of {executor.name}"] = max(at for at, _m in mine) - (at - m.seconds)
    notes = []
    for _at, m in loaded:
        parts[f"load {m.stage}"] = m.seconds
        if m.alongside:
            parts[f"  of which beside other stages {m.stage}"] = m.alongside
        if m.captured:
            parts[f"  of which graph capture {m.stage}"] = m.captured
        if m.capture_work:
            notes.append(f"{order}: {m.stage} captured {m.capture_work}")
    parts["link"] = ready - max(at for at, _m in loaded)
    parts["ready (process start -> ready)"] = ready - began
    if requests:
        parts["first request"], parts["second request"] = requests
    return parts, notes, memory_rows(plan, memory, order)


def main() -> None:
    args = arguments()
    began = time.perf_counter()
    plan = plan_of(args)
    compiled = time.perf_counter()
    checks = preflight(plan)
    checked = time.perf_counter()
    runs, notes, memory = [], [], []
    for order in args.load:
        parts, said, held = cold_start(plan, checks, order, args)
        runs.append(parts)
        notes += said
        memory += held
    for run in runs:
        if "first request" in run:
            run["total to first answer"] = (
                checked - began + run["ready (process start -> ready)"] + run["first request"]
            )
    names = ["compile", "preflight"]
    for run in runs:  # a part one run has and another lacks goes after its run's previous one
        for before, part in zip(["preflight", *run], run, strict=False):
            if part not in names:
                names.insert(names.index(before) + 1, part)
    rows = {part: [run.get(part) for run in runs] for part in names}
    rows["compile"] = [compiled - began] * len(runs)
    rows["preflight"] = [checked - compiled] * len(runs)
    print(f"{'part':<48}" + "".join(f" {'s, ' + order:>16}" for order in args.load))
    for part, values in rows.items():
        cells = "".join(f" {'-' if v is None else f'{v:.2f}':>16}" for v in values)
        print(f"{part:<48}{cells}")
    for note in notes:
        print(note)
    if memory:  # on CUDA only
        print(f"{'memory after load':<32}" + "".join(f" {h:>12}" for h in MEMORY_COLUMNS))
        for name, *sizes in memory:
            print(f"{name:<32}" + "".join(f" {size:>12}" for size in sizes))
    print(
        f"({args.graph.name} on devices {args.devices}; model {args.model_dir or 'tiny'}; "
        f"request {json.dumps(args.inputs) if args.inputs is not None else 'none'} "
        f"{args.params or ''}; executors start in parallel, so process start and load overlap "
        "across executors and do not add up, and so do the loads of one executor's stages "
        "loaded at once (`beside other stages`); a later cold start of a run finds the page "
        "cache warmer)"
    )


if __name__ == "__main__":
    main()
