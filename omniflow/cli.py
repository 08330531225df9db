"""The `omniflow` command line. Exit codes: 0 ok, 1 compile or run error, 2 usage error."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rich.console import Console

from omniflow.errors import OmniflowError


def _compile(args: argparse.Namespace) -> int:
    from omniflow.compiler import compile_file
    from omniflow.report import render_plan

    plan = compile_file(args.path, devices=args.devices, tiny=args.tiny)
    text = plan.to_json()
    if args.output:
        Path(args.output).write_text(text + "\n", encoding="utf-8")
    if args.json:
        sys.stdout.write(text + "\n")
    else:
        render_plan(plan, Console(width=args.width, highlight=False), timings=args.timings)
    return 0


def _run(args: argparse.Namespace) -> int:
    from omniflow.compiler import compile_file
    from omniflow.media import png_bytes, wav_bytes
    from omniflow.runtime.engine import Engine

    plan = compile_file(args.path, devices=args.devices, tiny=args.tiny)
    inputs = dict(_key_value(item) for item in args.input)
    params = {k: json.loads(v) for k, v in map(_key_value, args.param)}
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    backends = "standin" if args.standin else "auto"
    with Engine(plan, args.mode, backends=backends) as engine:
        outputs = engine.generate(inputs, params)
    for port in plan.outputs:
        value = outputs.get(port.name)
        if value is None:
            continue
        if port.type in ("text", "chat"):
            path, data = out_dir / f"{port.name}.txt", str(value).encode()
        elif port.type == "audio":
            path, data = (
                out_dir / f"{port.name}.wav",
                wav_bytes(value, port.attrs.get("rate", 24000)),
            )
        elif port.type == "image":
            path, data = out_dir / f"{port.name}.png", png_bytes(value)
        else:
            path, data = out_dir / f"{port.name}.pt", _tensor_bytes(value)
        path.write_bytes(data)
        shown = (
            f"  {value[:120]!r}{'...' if len(value) > 120 else ''}" if port.type == "text" else ""
        )
        print(f"{port.name}: {path}{shown}")
    return 0


def _key_value(item: str) -> tuple[str, str]:
    key, sep, value = item.partition("=")
    if not sep:
        raise OmniflowError(f"expected NAME=VALUE, not '{item}'")
    return key, value


def _tensor_bytes(value) -> bytes:
    import io

    import torch

    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _models(args: argparse.Namespace) -> int:
    from omniflow.models.tiny import TINY_MODELS, build_tiny, is_complete, tiny_cache_dir

    if args.models_command == "build-scaled":
        from omniflow.models.scaled import build_scaled_omni, scaled_checkpoint

        if args.out:
            print(build_scaled_omni(args.out, args.depth, args.device))
        else:
            print(scaled_checkpoint(args.depth, args.device))
        return 0
    if args.models_command == "list":
        for name, description in TINY_MODELS.items():
            built = "built" if is_complete(tiny_cache_dir() / name, name) else "not built"
            print(f"{name:18} {built:10} {description}")
        return 0
    if args.name not in TINY_MODELS:
        raise OmniflowError(f"unknown tiny model '{args.name}'; built-in: {', '.join(TINY_MODELS)}")
    print(build_tiny(args.name, args.out, progress=True))
    return 0


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="omniflow", description="Compile and serve .omni pipelines."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    comp = sub.add_parser("compile", help="compile a .omni file to a plan and print it")
    comp.add_argument("path", help="the .omni file")
    comp.add_argument(
        "--devices",
        default="cpu",
        help="device inventory: cpu | cuda:0,cuda:1 | 2xH200 | cuda:0=80GiB",
    )
    comp.add_argument("-o", "--output", help="also write the plan JSON to this file")
    comp.add_argument(
        "--json", action="store_true", help="print the plan as JSON instead of tables"
    )
    comp.add_argument(
        "--tiny", action="store_true", help="use the built-in tiny models of the same architectures"
    )
    comp.add_argument("--timings", action="store_true", help="print how long each pass took")
    comp.add_argument("--width", type=int, default=None, help=argparse.SUPPRESS)
    comp.set_defaults(run=_compile)
    run = sub.add_parser("run", help="run one request through a pipeline and write its outputs")
    run.add_argument("path", help="the .omni file")
    run.add_argument("--devices", default="cpu")
    run.add_argument(
        "--tiny", action="store_true", help="use the built-in tiny models of the same architectures"
    )
    run.add_argument(
        "--standin", action="store_true", help="deterministic stand-in stages instead of models"
    )
    run.add_argument("--mode", default="process", choices=("process", "inprocess"))
    run.add_argument(
        "--input",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a text input, or an image input's file path",
    )
    run.add_argument(
        "--param", action="append", default=[], metavar="NAME=JSON", help="a parameter override"
    )
    run.add_argument("--out", default="out", help="folder for the outputs (text, WAV, PNG)")
    run.set_defaults(run=_run)
    models = sub.add_parser(
        "models", help="tiny random-weight checkpoints of the real architectures"
    )
    verbs = models.add_subparsers(dest="models_command", required=True)
    verbs.add_parser("list", help="the built-in tiny models and whether they are built")
    build = verbs.add_parser(
        "build-tiny", help="build (or reuse) a tiny checkpoint and print its folder"
    )
    build.add_argument("name")
    build.add_argument(
        "--out", help="folder to build into (default: the cache, $OMNIFLOW_CACHE/tiny/NAME)"
    )
    scaled = verbs.add_parser(
        "build-scaled",
        help="build a random-weight Qwen2.5-Omni at the real model's widths, for GPU measurements",
    )
    scaled.add_argument(
        "--depth", type=float, default=1.0, help="fraction of the real layer counts (default 1)"
    )
    scaled.add_argument("--device", default="cuda", help="where to initialise it (default cuda)")
    scaled.add_argument(
        "--out", help="folder to build into (default: $OMNIFLOW_CACHE/scaled/qwen2.5-omni-DEPTH)"
    )
    models.set_defaults(run=_models)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    if getattr(args, "path", None) and not Path(args.path).is_file():
        print(f"omniflow: error: no such file: {args.path}", file=sys.stderr)
        return 2
    try:
        return args.run(args)
    except OmniflowError as err:
        print(err, file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
