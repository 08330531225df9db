"""The `omniflow` command line. Exit codes: 0 ok, 1 compile or run error, 2 usage error, 141
the reader of stdout left (a pipe into `head`)."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

from rich.console import Console

from omniflow.devices import this_machine
from omniflow.errors import OmniflowError, PassError, PlacementError, SourceError


def _compile(args: argparse.Namespace) -> int:
    from omniflow.compiler import optimize_file
    from omniflow.lower import lower
    from omniflow.report import render_plan

    snapshots = None
    if args.viz:
        from omniflow.profiler.viz import PassSnapshots

        snapshots = PassSnapshots()
    with _for_this_machine(args, args.path):
        graph = optimize_file(
            args.path,
            devices=args.devices,
            tiny=args.tiny,
            progress=True,
            on_pass=snapshots,
            model=args.model,
            settings=args.set,
        )
    plan = lower(graph)
    if snapshots is not None:
        _write_viz(args, snapshots, plan.pipeline)
    text = plan.to_json()
    if args.output:
        try:
            Path(args.output).write_text(text + "\n", encoding="utf-8")
        except OSError as err:
            raise UsageError(f"cannot write the plan to {args.output}: {err.strerror}") from err
    if args.json:
        sys.stdout.write(text + "\n")
    elif args.graph:
        sys.stdout.write(f"{graph}\n")
    else:
        render_plan(plan, _StdoutConsole(width=args.width, highlight=False), timings=args.timings)
    return 0


class _StdoutConsole(Console):
    """A console on stdout that leaves a closed pipe to `main` (rich's own exits 1)."""

    def on_broken_pipe(self) -> None:
        self.quiet = True
        raise BrokenPipeError


@contextlib.contextmanager
def _for_this_machine(args: argparse.Namespace, path: str | None) -> Iterator[None]:
    """With no `--devices`, compile for this machine (`args.devices` becomes its inventory);
    a graph at `path` that does not fit it fails with one line naming the flags that would
    compile it (`path` None: several graphs, the placement error as it is)."""
    detected = args.devices is None
    if detected:
        args.devices = this_machine()
    try:
        yield
    except PassError as err:
        if not (detected and path is not None and isinstance(err.cause, PlacementError)):
            raise
        raise OmniflowError(_does_not_fit(path, args.devices, args.set, err.cause)) from err


def _does_not_fit(path: str, here: str, settings: list[str], cause: Exception) -> str:
    """One line for a graph too big for this machine: which flags would compile it, else
    why it fits none (the placement's own reason here: the stage, what it needs, the
    `max_batch` at which it would fit)."""
    from omniflow.compiler import SUGGESTED_INVENTORIES, flags_that_fit

    need = "needs a GPU" if here == "cpu" else f"needs more than {here}"
    hints = {"--tiny": "--tiny for the built-in tiny models"}
    flags = [hints.get(flag, flag) for flag in flags_that_fit(path, here, settings)]
    if not flags:
        tried = f"{SUGGESTED_INVENTORIES[0]} to {SUGGESTED_INVENTORIES[-1]}"
        return f"{path} does not fit this machine ({here}) nor {tried}; give --devices. {cause}"
    return f"{path} does not fit this machine ({here}): {need}: try {', or '.join(flags)}"


def _run(args: argparse.Namespace) -> int:
    if args.model and (len(args.paths) != 1 or not args.paths[0].endswith(".omni")):
        raise UsageError(
            "--model replaces the model line of one .omni pipeline: "
            "omniflow run PIPELINE.omni --model MODEL_ID (or: omniflow serve MODEL_ID)"
        )
    if args.set and any(not p.endswith(".omni") for p in args.paths):
        raise UsageError(  # (no path: the default pipeline, one .omni file)
            "--set sets the stage arguments of .omni pipelines (a plan JSON is compiled): "
            "omniflow run PIPELINE.omni --set STAGE.KEY=VALUE"
        )
    if not (args.once or args.input or args.out is not None or args.profile is not None):
        # --input, --out and --profile imply --once
        from omniflow.server.launch import serve

        with _for_this_machine(args, args.paths[0] if len(args.paths) == 1 else None):
            return serve(args)
    from omniflow.compiler import compile_file
    from omniflow.run_once import run_once

    if args.profile is not None and (len(args.paths) != 1 or not (args.input or args.once)):
        # Without a request to record, the user most likely meant to profile a server.
        raise UsageError(
            "--profile records one request of one pipeline (--once --input ...); to profile "
            "a server, serve without --profile and POST /start_profile, then /stop_profile"
        )
    if len(args.paths) != 1:
        raise UsageError("--once runs one pipeline: omniflow run PIPELINE.omni --once ...")
    if args.profile_gpu and args.profile is None:
        raise UsageError("--profile-gpu adds to a profile: give --profile DIR too")
    inputs = dict(_key_value(item) for item in args.input)
    params = {k: _param_value(v) for k, v in map(_key_value, args.param)}
    with _for_this_machine(args, args.paths[0]):
        plan = compile_file(
            args.paths[0],
            devices=args.devices,
            tiny=args.tiny,
            progress=True,
            model=args.model,
            settings=args.set,
        )
    backends = "standin" if args.standin else "auto"
    console = Console(stderr=True, highlight=False)
    return run_once(
        plan,
        inputs,
        params,
        Path(args.out or "out"),
        mode=args.mode,
        backends=backends,
        load=args.load,
        console=console,
        profile=None if args.profile is None else Path(args.profile),
        profile_gpu=args.profile_gpu,
    )


def _serve(args: argparse.Namespace) -> int:
    """`omniflow serve MODEL`: `run` on the example graph that serves the model."""
    from omniflow.examples import example_graphs
    from omniflow.hints import did_you_mean
    from omniflow.supported import serving_graph, supported_models

    graph, _ = serving_graph(args.model_id)
    if graph is None:
        known = [m.model for m in supported_models() if m.graph]
        hint = did_you_mean(args.model_id, known, ignore_case=True) or "omniflow models list"
        raise OmniflowError(
            f"no example graph serves '{args.model_id}'; {hint} (or: omniflow run "
            "PIPELINE.omni --model MODEL)"
        )
    args.paths, args.model = [str(example_graphs()[graph])], args.model_id
    print(f"omniflow: serving {args.model_id} on {args.paths[0]}", file=sys.stderr)
    return _run(args)


def _key_value(item: str) -> tuple[str, str]:
    key, sep, value = item.partition("=")
    if not sep or not key:
        raise UsageError(f"expected NAME=VALUE, not '{item}'")
    return key, value


def _param_value(text: str):
    """A `--param` value: JSON (`3`, `0.5`, `true`, `"x"`), else the text itself."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def _models(args: argparse.Namespace) -> int:
    from omniflow import families
    from omniflow.checkpoints.tiny import build_tiny, is_complete, tiny_cache_dir

    if args.models_command is None:  # bare `omniflow models`: what it can do
        sys.stdout.write(args.models_help())
        return 0
    if args.models_command == "build-scaled":
        from omniflow.checkpoints.scaled import scaled_checkpoint

        print(scaled_checkpoint(args.model, args.depth, args.device, args.out))
        return 0
    tiny = families.tiny_models()
    if args.models_command == "list":
        _list_models(tiny, lambda name: is_complete(tiny_cache_dir() / name, name))
        return 0
    if args.name not in tiny:
        raise OmniflowError(f"unknown tiny model '{args.name}'; built-in: {', '.join(tiny)}")
    print(build_tiny(args.name, args.out, progress=True))
    return 0


def _list_models(tiny: dict, built: Callable[[str], bool]) -> None:
    """The real models supported, each with its example graph and tiny build; then every
    tiny model, built or not."""
    from omniflow.supported import supported_models

    def state(name: str) -> str:
        return "built" if built(name) else "not built"

    rows = [("model", "graph", "tiny build", "real-size")]
    for m in supported_models():
        graph = "-" if m.graph is None else f"{m.graph}{'' if m.named else ' (--model)'}"
        tiny_build = f"{m.tiny} ({state(m.tiny)})" if m.tiny else "-"
        rows.append((m.model, graph, tiny_build, "build-scaled" if m.scaled else "-"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=False)), row[-1])
    print("\n(--model): the graph serves another model of its family; name this one with --model")
    print("\ntiny models (--tiny swaps them in; omniflow models build-tiny NAME builds one)")
    for name, model in tiny.items():
        print(f"{name:22} {state(name):10} {model.description}")


def _write_viz(args: argparse.Namespace, snapshots, pipeline: str) -> None:
    from omniflow.profiler.viz import write_viz

    try:
        write_viz(snapshots, args.viz, pipeline, args.devices)
    except OSError as err:
        raise UsageError(f"cannot write {args.viz}: {err.strerror}") from err
    print(f"omniflow: the passes, drawn: {args.viz}", file=sys.stderr)


def _profile(args: argparse.Namespace) -> int:
    """`omniflow profile TRACE.json -o report.html`: a trace's self-contained HTML report."""
    from omniflow.profiler.report import load_trace, write_report

    try:
        trace = load_trace(args.path)
    except (ValueError, UnicodeDecodeError) as err:
        raise UsageError(f"{args.path} is not a JSON trace: {err}") from err
    if not isinstance(trace, dict) or not isinstance(trace.get("traceEvents"), list):
        raise UsageError(f"{args.path} is not a Chrome trace (no traceEvents)")
    out = Path(args.output) if args.output else Path(args.path).with_suffix(".html")
    try:
        write_report(trace, out)
    except OSError as err:
        raise UsageError(f"cannot write the report to {out}: {err.strerror}") from err
    print(f"omniflow: report: {out} ({out.stat().st_size / 1024:.0f} KiB)", file=sys.stderr)
    return 0


MODEL_HELP = (
    "serve this model (a hub id or a local folder) in place of the pipeline's model line: "
    "another model of its family, e.g. Qwen/Qwen3-TTS-12Hz-1.7B-Base on graphs/qwen3_tts.omni"
)


class _Parser(argparse.ArgumentParser):
    """argparse, a mistake on the command line said in one line with a pointer to `-h`, as
    every other start-up mistake is (not the whole usage first)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (`{self.prog} -h` for its options)\n")


def make_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="omniflow", description="Compile and serve .omni pipelines.")
    parser.add_argument(
        "--debug", action="store_true", help="show Python tracebacks (also: OMNIFLOW_DEBUG=1)"
    )
    sub = parser.add_subparsers(dest="command", required=True, help="what to do")
    comp = sub.add_parser(
        "compile",
        help="compile a .omni file to a plan and print it",
        description="Compile a .omni pipeline for a device inventory and print the plan: its "
        "executors, each stage's device, memory budget and batch, and the edges between them "
        "(docs/language.md). With no --devices, for this machine.",
    )
    comp.add_argument("path", help="the .omni file")
    comp.add_argument(
        "--devices",
        default=None,
        help="device inventory: cpu | cuda:0,cuda:1 | 2xH200 | cuda:0=80GiB | "
        "node0=2xH200,node1=2xH200 | ray:auto | ray://HOST:PORT (default: this machine's "
        "CUDA devices, else cpu)",
    )
    comp.add_argument("-o", "--output", help="also write the plan JSON to this file")
    shown = comp.add_mutually_exclusive_group()
    shown.add_argument(
        "--json", action="store_true", help="print the plan as JSON instead of tables"
    )
    shown.add_argument(
        "--graph",
        action="store_true",
        help="print the IR graph after the passes, with the facts each wrote, instead of tables",
    )
    comp.add_argument(
        "--tiny", action="store_true", help="use the built-in tiny models of the same architectures"
    )
    comp.add_argument("--model", metavar="MODEL_ID", help=MODEL_HELP)
    _add_set_option(comp)
    comp.add_argument("--timings", action="store_true", help="print how long each pass took")
    comp.add_argument(
        "--viz", metavar="OUT.html", help="also draw the graph after each pass into this HTML file"
    )
    comp.add_argument("--width", type=int, default=None, help=argparse.SUPPRESS)
    comp.set_defaults(run=_compile)
    run = sub.add_parser(
        "run",
        help="serve pipelines over an OpenAI-compatible HTTP API (--once: one request to files)",
        description="Serve pipelines over an OpenAI-compatible HTTP API (docs/server.md); with "
        "no pipeline, graphs/omni_chat.omni on the tiny models. --once runs one request and "
        "writes its outputs as files.",
    )
    run.add_argument(
        "paths", nargs="*", metavar="PIPELINE", help=".omni files or plan JSON files to serve"
    )
    _add_serving_options(run)
    run.set_defaults(run=_run)
    serve = sub.add_parser(
        "serve",
        help="serve a model by its hub id or folder, on the example graph of its architecture",
        description="Serve a model by its hub id (omniflow models list) or a local checkpoint "
        "folder: the example graph that serves its family and architecture, with the model "
        "in place of the graph's own (as omniflow run GRAPH.omni --model MODEL). Takes run's "
        "flags.",
    )
    serve.add_argument(
        "model_id", metavar="MODEL", help="a hub id (omniflow models list) or a checkpoint folder"
    )
    _add_serving_options(serve, with_model=False)
    serve.set_defaults(run=_serve)
    prof = sub.add_parser(
        "profile",
        help="make a self-contained HTML report of a profile's trace (trace.json)",
        description="Make a self-contained HTML report of a trace written by `omniflow run "
        "--profile` or a server's /stop_profile (docs/profiling.md).",
    )
    prof.add_argument("path", metavar="TRACE.json", help="a trace written by a profile")
    prof.add_argument("-o", "--output", help="the report's path (default: TRACE.html)")
    prof.set_defaults(run=_profile)
    models = sub.add_parser(
        "models",
        help="the models supported, and their tiny and scaled random-weight builds",
        description="The models supported, and random-weight checkpoints of their "
        "architectures: tiny ones that run anywhere, scaled ones at the real widths.",
    )
    verbs = models.add_subparsers(dest="models_command", metavar="VERB", help="what to do")
    verbs.add_parser(
        "list",
        help="the real models supported, their example graphs and tiny builds",
        description="The real models supported: each with the example graph that serves it, "
        "its tiny build (and whether it is built) and whether a real-size random-weight "
        "build exists; then every built-in tiny model.",
    )
    build = verbs.add_parser(
        "build-tiny",
        help="build (or reuse) a tiny checkpoint and print its folder",
        description="Build (or reuse) a tiny random-weight checkpoint and print its folder.",
    )
    build.add_argument("name", help="the tiny model (omniflow models list names them)")
    build.add_argument(
        "--out",
        help="folder to build into (default: the cache, $OMNIFLOW_CACHE/tiny/LIBRARIES/NAME)",
    )
    scaled = verbs.add_parser(
        "build-scaled",
        help="build a random-weight model at the real model's widths, for GPU measurements",
        description="Build a random-weight model at the real model's widths and print its "
        "folder, for GPU measurements without the real weights.",
    )
    scaled.add_argument(
        "model",
        nargs="?",
        default="Qwen/Qwen2.5-Omni-7B",
        help="the real model to build (default Qwen/Qwen2.5-Omni-7B)",
    )
    scaled.add_argument(
        "--depth", type=float, default=1.0, help="fraction of the real layer counts (default 1)"
    )
    scaled.add_argument("--device", default="cuda", help="where to initialise it (default cuda)")
    scaled.add_argument(
        "--out", help="folder to build into (default: $OMNIFLOW_CACHE/scaled/MODEL-DEPTH)"
    )
    models.set_defaults(run=_models, models_help=models.format_help)
    return parser


EXIT_BROKEN_PIPE = 141


def _add_set_option(parser: argparse.ArgumentParser) -> None:
    """`--set [PIPELINE.]STAGE.KEY=VALUE`, once a setting (`compile`, `run`, `serve`): stage
    arguments."""
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="[PIPELINE.]STAGE.KEY=VALUE",
        help="a stage's argument in place of the file's, written as there: --set "
        "thinker.max_batch=8 --set talker.max_len=3072 (e.g. to fit a smaller GPU); "
        "with several pipelines served, STAGE.KEY=VALUE sets every one with that stage, "
        "PIPELINE.STAGE.KEY=VALUE one of them",
    )


def _at_least(low: int) -> Callable[[str], int]:
    """An argparse type: a whole number of at least `low`."""

    def whole(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, not {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"expected at least {low}, not {value}")
        return value

    return whole


def _port(text: str) -> int:
    """An argparse type: a TCP port (0: any free one)."""
    value = _at_least(0)(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"expected a port, 0 to 65535, not {value}")
    return value


def _seconds(zero: bool = False) -> Callable[[str], float]:
    """An argparse type: a finite number of seconds above 0 (`zero`: from 0)."""

    def seconds(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected seconds, not {text!r}") from None
        if not math.isfinite(value) or value < 0 or (value == 0 and not zero):
            least = "0 or more" if zero else "above 0"
            raise argparse.ArgumentTypeError(f"expected finite seconds {least}, not {text}")
        return value

    return seconds


def _add_serving_options(parser: argparse.ArgumentParser, with_model: bool = True) -> None:
    """The flags of `run` and `serve`: devices, models, serving limits, --once."""
    parser.add_argument(
        "--devices",
        default=None,
        help="device inventory, as for compile (default: this machine's CUDA devices, else "
        "cpu); ray:auto or ray://HOST:PORT runs the executors as Ray actors on that cluster "
        "(docs/deploy.md)",
    )
    parser.add_argument(
        "--tiny", action="store_true", help="use the built-in tiny models of the same architectures"
    )
    if with_model:
        parser.add_argument("--model", metavar="MODEL_ID", help=MODEL_HELP)
    _add_set_option(parser)
    parser.add_argument(
        "--standin", action="store_true", help="deterministic stand-in stages instead of models"
    )
    parser.add_argument(
        "--mode",
        default="process",
        choices=("process", "inprocess", "ray"),
        help="where executors run: process (default) one OS process each; inprocess threads of "
        "this process (debugging); ray: Ray actors (a ray: inventory implies it)",
    )
    parser.add_argument(
        "--load",
        default="sequential",
        choices=("auto", "sequential", "parallel"),
        help="how an executor loads its stages: sequential (default: one after another), "
        "parallel (a thread each, each held to its budget in its own allocator pool), auto "
        "(parallel where two or more of an executor's stages are on a GPU); parallel is "
        "experimental: on a GPU it aborted a test's process",
    )
    parser.add_argument(
        "--param",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a parameter value (JSON, else a string): --param steps=4 --param speaker=Ethan; "
        "served, it is the requests' default ([PIPELINE.]NAME=VALUE)",
    )
    serving = parser.add_argument_group("serving")
    serving.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    serving.add_argument(
        "--port", type=_port, default=8091, help="port to listen on (default 8091; 0: any free one)"
    )
    serving.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' (also: OMNIFLOW_API_KEY)",
    )
    serving.add_argument(
        "--protect-metrics", action="store_true", help="/metrics needs the API key too"
    )
    serving.add_argument(
        "--max-in-flight",
        action="append",
        default=[],
        metavar="[PIPELINE=]N",
        help="requests run at once (default: the plan's capacity); beyond it they queue",
    )
    serving.add_argument(
        "--max-queue",
        action="append",
        default=[],
        metavar="[PIPELINE=]N",
        help="requests that may wait for a slot (default 4 x --max-in-flight); beyond: 503",
    )
    serving.add_argument(
        "--max-queue-wait",
        type=_seconds(),
        default=600.0,
        metavar="SECONDS",
        help="longest a request waits for a slot before a 503 (default 600)",
    )
    serving.add_argument(
        "--max-body-bytes",
        type=_at_least(1),
        default=32 << 20,
        help="largest request body (default 32 MiB); beyond it: 413",
    )
    serving.add_argument(
        "--max-voices",
        type=_at_least(0),
        default=64,
        help="uploaded voices kept at once, all pipelines (default 64); beyond it: 400",
    )
    serving.add_argument(
        "--allow-remote-media",
        action="store_true",
        help="let requests name http(s) URLs for their media (off: data: URIs and uploads)",
    )
    serving.add_argument(
        "--allowed-media-dir",
        action="append",
        default=[],
        metavar="DIR",
        help="a directory whose files requests may name as media by path (repeatable; "
        "default: none, no local path is read)",
    )
    serving.add_argument(
        "--max-image-pixels",
        type=_at_least(1),
        metavar="N",
        help="largest image a request may send, width x height, checked before decoding "
        "(default 8192 x 8192); beyond it: 400",
    )
    serving.add_argument(
        "--max-audio-seconds",
        type=_seconds(),
        metavar="SECONDS",
        help="longest audio a request may send, checked before decoding (default 600; "
        "voice references: 60); beyond it: 400",
    )
    serving.add_argument(
        "--max-video-pixels",
        type=_at_least(1),
        metavar="N",
        help="largest video a request may send, frames x width x height, checked before "
        "decoding (default: two minutes of 720p at 30 fps); beyond it: 400",
    )
    serving.add_argument(
        "--drain-timeout",
        type=_seconds(zero=True),
        default=30.0,
        help="on SIGINT/SIGTERM, seconds to wait for requests in flight (default 30)",
    )
    serving.add_argument(
        "--max-video-jobs",
        type=_at_least(1),
        default=32,
        help="video jobs held at once, queued, running or finished and kept (default 32); "
        "beyond it: 429",
    )
    serving.add_argument(
        "--video-ttl",
        type=_seconds(),
        default=3600.0,
        help="seconds a finished video job and its MP4 are kept (default 3600)",
    )
    serving.add_argument(
        "--max-realtime-sessions",
        type=_at_least(1),
        default=64,
        metavar="N",
        help="/v1/realtime sessions open at once (default 64); beyond it a new one gets an "
        "error event and is closed (1013)",
    )
    serving.add_argument(
        "--max-realtime-text",
        type=_at_least(1),
        default=256 << 10,
        metavar="CHARS",
        help="characters of text a realtime session holds, its instructions and items "
        "(default 262144)",
    )
    serving.add_argument(
        "--realtime-idle-timeout",
        type=_seconds(),
        default=600.0,
        metavar="SECONDS",
        help="a realtime session with no client event and no response running for this "
        "long is closed (default 600)",
    )
    serving.add_argument(
        "--max-speech-sessions",
        type=_at_least(1),
        default=64,
        metavar="N",
        help="/v1/audio/speech/stream sessions open at once (default 64); beyond it a new "
        "one gets an error message and is closed (1013)",
    )
    serving.add_argument(
        "--speech-idle-timeout",
        type=_seconds(),
        default=600.0,
        metavar="SECONDS",
        help="a speech stream session with no client message and nothing being spoken for "
        "this long is closed (default 600)",
    )
    serving.add_argument(
        "--log-stats", action="store_true", help="print per-request stats tables after each"
    )
    serving.add_argument(
        "--log-stats-json", metavar="FILE", help="append per-request stats as JSON lines to FILE"
    )
    serving.add_argument("--access-log", action="store_true", help="log every HTTP request")
    once = parser.add_argument_group("one request (--once)")
    once.add_argument(
        "--once",
        action="store_true",
        help="run one request and write its outputs as files (--input and --out imply it)",
    )
    once.add_argument(
        "--input",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a text input, or an image input's file path",
    )
    once.add_argument("--out", default=None, help="folder for the outputs (default out/)")
    once.add_argument(
        "--profile",
        default=None,
        metavar="DIR",
        help="record the request's events; write DIR/trace.json and DIR/report.html (a "
        "server records between POST /start_profile and /stop_profile instead)",
    )
    once.add_argument(
        "--profile-gpu",
        action="store_true",
        help="with --profile: add the CUDA kernel timeline of the GPU stages (torch profiler)",
    )


class UsageError(OmniflowError):
    """A command line that cannot be carried out as written."""


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    # A pipeline's python stages and adapters import from the working directory too, after
    # installed packages, where `python -m omniflow.cli` puts it first: there a folder named
    # as an installed package shadows it (this repository's own kernels/, PyPI's `kernels`
    # that transformers imports), in this process and in the executors, which take its path.
    cwd = os.getcwd()
    sys.path[:] = [*(p for p in sys.path if p not in ("", cwd)), cwd]
    debug = args.debug or os.environ.get("OMNIFLOW_DEBUG", "") not in ("", "0")
    try:  # a bare example name (`qwen3_tts`) is that example graph, here or installed
        if getattr(args, "path", None):
            args.path = _existing_file(args.path)
        if getattr(args, "paths", None):
            args.paths = [_existing_file(path) for path in args.paths]
    except UsageError as err:
        print(_one_message(err), file=sys.stderr)
        return 2
    try:
        code = args.run(args)
        sys.stdout.flush()  # here, where a closed pipe is caught, not at interpreter exit
        return code
    except BrokenPipeError:
        # The reader left (`omniflow compile ... | head`): end quietly, as a shell tool killed
        # by SIGPIPE does (128 + 13), with stdout pointed where the final flush cannot fail.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
    except KeyboardInterrupt:
        print("omniflow: interrupted", file=sys.stderr)
        return 130
    except Exception as err:
        if debug:
            raise
        print(_one_message(err), file=sys.stderr)
        return 2 if isinstance(err, UsageError) else 1


def _existing_file(name: str) -> str:
    from omniflow.examples import find_pipeline

    found = find_pipeline(name)
    if found is None:
        raise UsageError(f"no such file: {name}")
    return str(found)


def _one_message(err: Exception) -> str:
    """What a user reads instead of a traceback."""
    if isinstance(err, PassError) and isinstance(err.cause, SourceError) and err.cause.span:
        err = err.cause  # a pass's finding in the file: where it is, not which pass found it
    if isinstance(err, SourceError):
        return str(err)  # already `file:line:col: error: ...` with the line and a caret
    if isinstance(err, OmniflowError):
        return f"omniflow: error: {err}"
    if isinstance(err, OSError):
        where = f": {err.filename}" if err.filename else ""
        return f"omniflow: error: {err.strerror or err}{where}"
    return (
        f"omniflow: internal error: {type(err).__name__}: {err}\n"
        "this is a bug in omniflow; rerun with --debug (or OMNIFLOW_DEBUG=1) for the traceback"
    )


if __name__ == "__main__":
    sys.exit(main())
