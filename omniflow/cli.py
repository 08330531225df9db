"""The `omniflow` command line. Exit codes: 0 ok, 1 compile or run error, 2 usage error."""

from __future__ import annotations

import argparse
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
    return parser


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    if args.command == "compile" and not Path(args.path).is_file():
        print(f"omniflow: error: no such file: {args.path}", file=sys.stderr)
        return 2
    try:
        return args.run(args)
    except OmniflowError as err:
        print(err, file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
